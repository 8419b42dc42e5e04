"""kvbm's TensorRT-LLM adapter as pure logic: settings, the KV region, request keys, the scheduler
role against a fake leader, the worker role's id bookkeeping and failure rules (no daemons)."""
from __future__ import annotations

import json
import mmap
import os
import time
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvbm_client.connectors.core.settings import LoadMode
from kvbm_client.connectors.core.specs import LoadSpec, StepPlan, StoreSpec
from kvbm_client.connectors.trtllm.kv_region import describe_kv_cache, find_mapping
from kvbm_client.connectors.trtllm.requests import request_extras
from kvbm_client.connectors.trtllm.scheduler import KvbmConnectorScheduler
from kvbm_client.connectors.trtllm.settings import CONFIG_ENV, config_warnings, trtllm_settings
from kvbm_client.connectors.trtllm.worker import AsyncIds, KvbmConnectorWorker
from kvbm_client.errors import KvbmTransferError
from kvbm_client.hashing import MultimodalSpan, RequestExtras
from kvbm_client.regions import LayerSpec
from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import RequestData, SchedulerOutput
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm.bindings import LlmRequestState
from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs, _ParallelConfig

from .connector_runtime import BoundRequestView
from .driver_setup import ConnectorFactories
from .paged_kv import PagedKvCache
from .scenarios import GEOMETRY

B = 4
REPO = Path(__file__).resolve().parents[2]


def llm_args(tp: int = 1, rank: int = 0, disable_overlap_scheduler: bool = False, **kv) -> TorchLlmArgs:
    kv = {"enable_partial_reuse": False, "tokens_per_block": B, **kv}
    return TorchLlmArgs(kv_cache_config=KvCacheConfig(**kv), parallel_config=_ParallelConfig(tp_size=tp, rank=rank),
                        disable_overlap_scheduler=disable_overlap_scheduler)


@pytest.fixture
def options(monkeypatch, tmp_path):
    """Connector options of these tests: no early loads (no worker daemon to send them to)."""
    def set_options(**extra):
        monkeypatch.setenv(CONFIG_ENV, json.dumps({"early_loads": False, "socket_dir": str(tmp_path / "s"), **extra}))
    set_options()
    return set_options


# ---------------------------------------------------------------- settings


def test_settings_come_from_llm_args_and_the_environment(options):
    options(load_mode="async", retry_s=0.5)
    s = trtllm_settings(llm_args(tp=2, rank=1))
    assert (s.block_size, s.rank, s.world_size, s.worker_ids, s.worker_id) == (B, 1, 2, ("0", "1"), "1")
    assert s.core.load_mode is LoadMode.ASYNC and s.core.retry_s == 0.5 and not s.core.early_loads
    assert s.core.namespace == f"trtllm|standin-model|auto|kv=auto|{B}|tp=2"


@pytest.mark.parametrize("raw, error", [("{not json", "not JSON"), ("[1]", "JSON object"),
                                        ('{"load_mode": "eager"}', "load_mode"),
                                        ('{"worker_id": "3"}', "2 ranks")])
def test_bad_connector_options_are_refused(monkeypatch, raw, error):
    monkeypatch.setenv(CONFIG_ENV, raw)
    with pytest.raises(ValueError, match=error):
        trtllm_settings(llm_args(tp=2))


def test_the_guides_config_draws_no_warning_and_each_departure_one():
    assert config_warnings(llm_args()) == []
    bad = TorchLlmArgs(kv_cache_config=KvCacheConfig(enable_block_reuse=False, enable_partial_reuse=True),
                       cuda_graph_config=object())
    assert [w.split(" ")[0] for w in config_warnings(bad)] == [
        "kv_cache_config.enable_block_reuse", "kv_cache_config.enable_partial_reuse", "cuda_graph_config"]


def test_the_deploy_config_names_these_classes_with_the_guides_settings():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((REPO / "deploy/trtllm/kvbm_llm_api_config.yaml").read_text())
    factories = ConnectorFactories.from_config(KvCacheConnectorConfig(**config["kv_connector_config"]))
    assert (factories.scheduler, factories.worker) == (KvbmConnectorScheduler, KvbmConnectorWorker)
    args = TorchLlmArgs(kv_cache_config=KvCacheConfig(**config["kv_cache_config"]),
                        cuda_graph_config=config["cuda_graph_config"])
    assert config["backend"] == "pytorch" and config_warnings(args) == []


# ---------------------------------------------------------------- the KV region

MAPS = """7f00-7f10 rw-s 00001000 00:1a 42 /dev/shm/pool
7f10-7f20 rw-p 00000000 00:00 0
7f20-7f30 rw-p 00000000 00:1a 43 /dev/shm/private
7f30-7f40 rw-s 00000000 00:01 44 /memfd:kv (deleted)
"""


@pytest.mark.parametrize("address, length, found", [
    (0x7f04, 8, (42, 0x1004)),  # inside a shared file mapping
    (0x7f0c, 8, None),  # runs past its end
    (0x7f14, 4, None),  # anonymous memory
    (0x7f24, 4, None),  # a private mapping
    (0x7f34, 4, (44, 4)),  # a memfd (its fd is looked up by inode)
    (0x8000, 4, None)])  # not mapped
def test_a_shared_file_mapping_is_found_in_proc_maps(address, length, found):
    assert find_mapping(MAPS, address, length) == found


def test_a_cpu_pool_in_a_sealed_memfd_is_described_as_one_page_per_block():
    cache = PagedKvCache(GEOMETRY, 16, rank=0)
    try:
        cache.tensor[3].view(torch.int16).copy_(torch.arange(cache.tensor[3].numel(), dtype=torch.int16).view(
            cache.tensor[3].shape))
        whole = describe_kv_cache(cache.tensor, "e")
        tail = describe_kv_cache(cache.tensor[2:], "e")
        size = os.fstat(cache.memfd).st_size
        assert (whole.memfds, whole.buffer_sizes, whole.page_bytes, whole.num_blocks, whole.dtype) == \
            ((cache.memfd,), (size,), GEOMETRY.bytes_per_block, 16, "float16")
        assert whole.layers == (LayerSpec(0, 0, GEOMETRY.bytes_per_block),)
        assert tail.num_blocks == 14 and tail.layers == (LayerSpec(0, 2 * GEOMETRY.bytes_per_block,
                                                                   GEOMETRY.bytes_per_block),)
        with mmap.mmap(cache.memfd, size, access=mmap.ACCESS_READ) as m:
            start = tail.layers[0].offset_bytes + 1 * tail.layers[0].block_stride_bytes  # tail block 1 = block 3
            assert m[start:start + tail.page_bytes] == cache.tensor[3].numpy().tobytes()
    finally:
        cache.close()


def test_a_pool_in_an_unsealed_shared_file_is_refused(tmp_path):
    """A /dev/shm-style file could be truncated under the daemon's mapping: not described."""
    path = tmp_path / "pool"
    path.write_bytes(b"\0" * (4 * 2 * 2 * 16 * 2))
    pool = torch.from_file(str(path), shared=True, size=4 * 2 * 2 * 16, dtype=torch.float16).view(4, 2, 2, 16)
    with pytest.raises(ValueError, match="sealed memfd"):
        describe_kv_cache(pool, "e")


def test_memory_a_worker_daemon_cannot_map_is_refused():
    with pytest.raises(ValueError, match="sealed memfd"):
        describe_kv_cache(torch.zeros(4, 2, 2, 16, dtype=torch.float16), "e")
    with pytest.raises(ValueError, match="pool"):
        describe_kv_cache(torch.zeros(4, 2, 16), "e")


# ---------------------------------------------------------------- request keys


def test_salt_lora_and_multimodal_inputs_are_part_of_the_key():
    plain = LlmRequest(7, 4, [1, 2, 3])
    assert request_extras(BoundRequestView(plain)) == RequestExtras()
    tenant = BoundRequestView(LlmRequest(7, 4, [1, 2, 3], lora_task_id=3, cache_salt_id=2**63 + 5))
    assert request_extras(tenant) == RequestExtras(cache_salt=f"salt-id:{2**63 + 5}", lora_name="lora-task:3")
    image = SimpleNamespace(multimodal_hashes=[[1, -1] * 4, [2] * 8], multimodal_positions=[9, 2],
                            multimodal_lengths=[3, 4])
    assert request_extras(image).multimodal == (MultimodalSpan("00000002" * 8, 2, 4),
                                                MultimodalSpan("00000001ffffffff" * 4, 9, 3))
    assert request_extras(SimpleNamespace(multimodal_hashes=[[1] * 8], multimodal_positions=[1])) is None
    assert request_extras(SimpleNamespace(multimodal_hashes=[[1] * 7], multimodal_positions=[1],
                                          multimodal_lengths=[1])) is None


# ---------------------------------------------------------------- scheduler role


class FakeLeader:
    """TEST DOUBLE of the leader link: holds ``stored`` leading blocks of any request; records calls."""

    def __init__(self, stored: int = 0) -> None:
        self.stored = stored
        self.loads: list[int] = []  # blocks asked for, per PrepareLoad
        self.stores: list[int] = []  # blocks offered, per PrepareStore

    def prepare_load(self, hashes, count_hit=False, tokens_per_block=0, prefill_tokens_per_s=0.0, stage=None):
        self.loads.append(len(hashes))
        n = min(self.stored, len(hashes))
        return SimpleNamespace(num_blocks=n, is_empty=n == 0, deadline=time.monotonic() + 30,
                               signed=SimpleNamespace(plan=b"p", signature=b"s"), skipped_cost=0)

    def prepare_store(self, hashes):
        self.stores.append(len(hashes))
        return SimpleNamespace(is_empty=False, indices=list(range(len(hashes))), deadline=time.monotonic() + 30,
                               signed=SimpleNamespace(plan=b"p", signature=b"s"))

    def may_hold(self, key):
        return True  # (no presence filter: every lookup asks)

    def unasked(self, blocks):
        pass

    def release(self, handle):
        pass

    def close(self):
        pass


def scheduler(leader: FakeLeader) -> KvbmConnectorScheduler:
    return KvbmConnectorScheduler(llm_args(), leader=leader)


def new(req: LlmRequest, blocks, computed: int, scheduled: int) -> SchedulerOutput:
    return SchedulerOutput(new_requests=[RequestData(req.request_id, req.get_tokens(0), list(blocks), computed,
                                                     scheduled)])


def test_answers_keep_tensorrt_llms_rules(options):
    role = scheduler(FakeLeader(stored=100))
    prompt = LlmRequest(1, 4, list(range(21)))
    assert role.get_num_new_matched_tokens(BoundRequestView(prompt), 2 * B) == (3 * B, False)  # 8 + 12 < 21
    exact = LlmRequest(2, 4, list(range(5 * B)))
    assert role.get_num_new_matched_tokens(BoundRequestView(exact), 0) == (4 * B, False)  # the last block stays
    asked = len(role.core._leader.loads)
    inside = LlmRequest(3, 4, list(range(21)))
    assert role.get_num_new_matched_tokens(BoundRequestView(inside), B + 2) == (0, False)  # partial device match
    assert len(role.core._leader.loads) == asked, "a partial device match asked the leader"
    options(load_mode="async")
    miss = scheduler(FakeLeader(stored=0))
    assert miss.get_num_new_matched_tokens(BoundRequestView(LlmRequest(4, 4, list(range(21)))), 0) == (0, False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_hit_loads_after_the_device_match_and_only_computed_blocks_are_stored(options, mode):
    """41 prompt tokens: 1 block on the device, 4 from kvbm, then an 8-token chunk: blocks 5 and 6
    complete. TensorRT-LLM reports the chunk's position without kvbm's tokens when the request is new
    in its lookup's iteration (sync), with them when it resumes after a parked load (async)."""
    options(load_mode=mode)
    leader = FakeLeader(stored=4)
    role = scheduler(leader)
    req = LlmRequest(9, 4, list(range(41)))
    assert role.get_num_new_matched_tokens(BoundRequestView(req), B) == (4 * B, mode == "async")
    blocks = list(range(20, 31))
    role.update_state_after_alloc(req, blocks)
    if mode == "sync":
        plan = role.build_connector_meta(new(req, blocks, B, 8))
    else:
        plan = role.build_connector_meta(SchedulerOutput())  # parked: not in the output
        assert leader.stores == []
    (load,) = plan.loads
    assert (load.engine_blocks, load.sync) == (blocks[1:5], mode == "sync")
    if mode == "async":
        plan = role.build_connector_meta(new(req, blocks, 5 * B, 8))
    assert leader.stores == [2] and plan.stores[0].engine_blocks == blocks[5:7]


def test_the_metadata_pickles_and_is_never_touched_after_it_is_returned(options):
    role = scheduler(FakeLeader(stored=4))
    req = LlmRequest(9, 4, list(range(41)))
    role.get_num_new_matched_tokens(BoundRequestView(req), 0)
    role.update_state_after_alloc(req, list(range(11)))
    plan = role.build_connector_meta(new(req, range(11), 0, 41))
    frozen = pickle.dumps(plan)
    assert pickle.loads(frozen) == plan and plan.loads and plan.stores
    req.add_new_token(5, 0)
    role.build_connector_meta(SchedulerOutput(cached_requests=[RequestData(9, [5], [11], 41, 1)]))
    assert role.request_finished(req, list(range(12))) is True  # it has stores: keep the blocks
    role.build_connector_meta(SchedulerOutput())
    assert pickle.dumps(plan) == frozen


def test_a_request_terminated_without_request_finished_is_dropped_and_fences(options):
    role = scheduler(FakeLeader(stored=0))
    req = LlmRequest(9, 4, list(range(17)))
    role.get_num_new_matched_tokens(BoundRequestView(req), 0)
    role.update_state_after_alloc(req, list(range(5)))
    assert role.build_connector_meta(new(req, range(5), 0, 17)).stores
    req.state = LlmRequestState.GENERATION_COMPLETE  # _handle_errors: failed and freed, no request_finished
    first = role.build_connector_meta(SchedulerOutput())
    assert role.num_tracked == 1 and not first.fence
    second = role.build_connector_meta(SchedulerOutput())
    assert role.num_tracked == 0 and second.fence, "its blocks are free: stores reading them must finish first"


# ---------------------------------------------------------------- worker role


def test_asynchronous_ids_are_returned_once_and_only_after_they_were_passed_in():
    ids = AsyncIds()
    assert ids.passed([], []) == []
    assert ids.report([], ["7"]) == ([], []), "loaded before TensorRT-LLM named it"
    assert ids.passed([5], [7]) == ["5"]
    assert ids.report(["5"], []) == ([5], [7])
    assert ids.report(["5"], ["7"]) == ([], [])


def test_a_request_cancelled_while_its_load_runs_keeps_its_blocks_until_the_load_is_done(options):
    options(load_mode="async")
    role = scheduler(FakeLeader(stored=4))
    req = LlmRequest(9, 4, list(range(21)))
    assert role.get_num_new_matched_tokens(BoundRequestView(req), 0) == (4 * B, True)
    role.update_state_after_alloc(req, list(range(6)))
    role.build_connector_meta(SchedulerOutput())  # parked
    assert role.request_finished(req, list(range(6))) is True, "freed while the daemon may write into them"
    ids = AsyncIds()
    ids.passed([9], [9])
    assert ids.report(["9"], []) == ([], []), "reported saved before its load settled"
    assert ids.report([], ["9"]) == ([9], [9])


class FakeWorkerCore:
    """TEST DOUBLE of the worker core: records calls; ``errors`` are the blocks whose load failed."""

    worker_id = "0"

    def __init__(self, errors=()) -> None:
        self.errors, self.calls = set(errors), []

    def set_region(self, spec):
        self.calls.append("set_region")

    def fence(self):
        self.calls.append("fence")

    def start_loads(self, loads, wait=True, ready=None):
        if loads and ready is not None:
            ready()  # as the core does: first, before any load is sent
        self.calls.append(("start_loads", len(loads), wait))

    def wait_loads(self):
        self.calls.append("wait_loads")

    def take_load_errors(self):
        errors, self.errors = self.errors, set()
        return errors

    def start_stores(self, stores, ready=None):
        self.calls.append(("start_stores", len(stores)))

    def finished(self, delayed_frees=()):
        return set(delayed_frees), set()


PLAN = StepPlan(loads=[LoadSpec("1", b"p", b"s", [3, 4], sync=True)], stores=[StoreSpec(b"p", b"s", [7], ["2"])])


def test_a_failed_load_raises_from_the_first_layer_after_waiting_for_the_stores(options):
    core = FakeWorkerCore(errors={4})
    worker = KvbmConnectorWorker(llm_args(), core=core)
    worker.bind_connector_meta(PLAN)
    worker.start_load_kv(None)
    with pytest.raises(KvbmTransferError, match="1 blocks could not be loaded"):
        worker.wait_for_layer_load(0, None)
    assert core.calls == [("start_loads", 1, False), "wait_loads", "fence"]
    worker.get_finished([], [])
    assert core.calls[-1] == "fence", "the pass raised: its requests' blocks are free, stores must be done"


def test_a_pass_that_completes_stores_once_and_needs_no_fence(options):
    core = FakeWorkerCore()
    worker = KvbmConnectorWorker(llm_args(), core=core)
    worker.bind_connector_meta(PLAN)
    worker.start_load_kv(None)
    for layer in range(2):
        worker.wait_for_layer_load(layer, None)
        worker.save_kv_layer(layer, None)
    worker.wait_for_save(None)
    worker.wait_for_save(None)  # the same metadata again: nothing twice
    assert worker.get_finished([12], []) == ([12], [])
    assert core.calls == [("start_loads", 1, False), "wait_loads", ("start_stores", 1)]


class FakeStream:
    """TEST DOUBLE of the forward's CUDA stream: counts synchronizations."""

    def __init__(self, calls) -> None:
        self.calls = calls

    def synchronize(self):
        self.calls.append("stream.synchronize")


@pytest.mark.parametrize("disable_overlap,synchronized", [(False, True), (True, False)])
def test_gpu_loads_wait_for_the_previous_iteration_only_under_the_overlap_scheduler(options, disable_overlap,
                                                                                    synchronized):
    """Under the overlap scheduler TensorRT-LLM frees a finished request's blocks while the
    iteration that may still write them runs: a load into them waits until the forward stream
    ran it (the daemon copies on a stream of its own)."""
    core = FakeWorkerCore()
    worker = KvbmConnectorWorker(llm_args(disable_overlap_scheduler=disable_overlap), core=core)
    worker.kv_cache_tensor = SimpleNamespace(is_cuda=True)  # a GPU pool (registered without a daemon here)
    worker.bind_connector_meta(PLAN)
    worker.start_load_kv(FakeStream(core.calls))
    expected = ["stream.synchronize"] if synchronized else []
    assert core.calls == [*expected, ("start_loads", 1, False)]
    worker.bind_connector_meta(StepPlan(stores=PLAN.stores))
    worker.start_load_kv(FakeStream(core.calls))
    assert "stream.synchronize" not in core.calls[len(expected) + 1:], "a pass without loads does not wait"


@pytest.mark.parametrize("disable_overlap,early", [(False, False), (True, True)])
def test_early_loads_are_off_under_the_overlap_scheduler(options, monkeypatch, disable_overlap, early):
    options(early_loads=True)
    from kvbm_client.connectors.trtllm import scheduler as scheduler_module
    monkeypatch.setattr(scheduler_module, "EarlyLoads", lambda settings, workers: SimpleNamespace(close=lambda: None))
    args = llm_args(disable_overlap_scheduler=disable_overlap)
    assert trtllm_settings(args).overlap_scheduler is not disable_overlap
    role = scheduler_module.KvbmConnectorScheduler(args, leader=FakeLeader(stored=0))
    try:
        assert (role.core._early is not None) is early
    finally:
        role.shutdown()
