"""The executor-replaying driver, proven with test-double connectors.

Every run is compared with a run without any connector: the byte check (every held position of
every scheduled request equals what recompute writes) runs in every pass, and the output tokens,
which are computed from the KV bytes in the pool, must be identical.
"""
from __future__ import annotations

from functools import partial

import pytest
import torch

from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig

from .doubles import CallLog, RaisingConnectorWorker, RecomputeOnlyConnectorScheduler, RecomputeOnlyConnectorWorker
from .driver import ConnectorFactories, Driver, DriverConfig, DriverStallError
from .forward_pass import KvMismatchError
from .kv_model import KvGeometry
from .store_doubles import InMemoryBlockStore, StoreConnectorWorker, store_connector
from .scenarios import CONFIG, GEOMETRY, chats, prefix_then_extension
from .workload import RequestSpec, Sequential, random_tokens

def run(config=CONFIG, connectors=None, workload=None):
    with Driver(config, connectors) as driver:
        return driver.run(workload if workload is not None else chats())


def recompute_only(log=None, worker=RecomputeOnlyConnectorWorker, **worker_kw):
    return ConnectorFactories(partial(RecomputeOnlyConnectorScheduler, call_log=log),
                              partial(worker, call_log=log, **worker_kw))


@pytest.fixture(scope="module")
def baseline():
    return run().outputs()


def test_without_any_connector_the_check_runs_and_the_device_cache_is_exercised(baseline):
    report = run()
    assert report.outputs() == baseline and len(baseline) == 18
    assert report.stats.verified_positions > 0
    assert report.stats.device_reused_blocks > 0 and report.stats.device_evicted_blocks > 0


def test_recompute_only_connector_recomputes_everything_and_changes_nothing(baseline):
    report = run(connectors=ConnectorFactories.from_config(KvCacheConnectorConfig(
        "trtllm.doubles", "RecomputeOnlyConnectorScheduler", "RecomputeOnlyConnectorWorker")))
    assert report.outputs() == baseline
    assert report.stats.connector_matched_tokens == 0 and report.stats.verified_positions > 0


def test_calls_come_in_tensorrt_llms_order_with_its_scheduler_output():
    log = CallLog()
    spec = RequestSpec("one", random_tokens((1,), 10, 1000), max_new_tokens=3)
    report = run(connectors=recompute_only(log), workload=Sequential([spec]))
    rid = report.results["one"].request_id
    layers = ["wait_for_layer_load", "save_kv_layer"] * 2
    step = ["build_connector_meta", "bind_connector_meta", "start_load_kv", *layers, "wait_for_save"]
    assert log.methods() == ["register_kv_caches", "get_num_new_matched_tokens", "update_state_after_alloc",
                             *step, "get_finished", *step, "get_finished", *step, "request_finished", "get_finished"]
    calls = {m: d for _, _, m, d in log.entries if m in ("get_num_new_matched_tokens", "update_state_after_alloc")}
    assert calls["get_num_new_matched_tokens"] == (rid, 0)
    assert calls["update_state_after_alloc"][0] == rid and len(calls["update_state_after_alloc"][1]) == 3
    outputs = [d for _, _, m, d in log.entries if m == "build_connector_meta"]
    first, second, third = outputs
    (new,) = first.new_requests
    assert (new.request_id, new.new_tokens, new.computed_position, new.num_scheduled_tokens) == (rid, list(spec.tokens), 0, 10)
    assert new.new_block_ids == list(calls["update_state_after_alloc"][1])
    tokens = report.results["one"].output_tokens
    assert [(c.new_tokens, c.new_block_ids, c.computed_position, c.num_scheduled_tokens) for c in
            (second.cached_requests[0], third.cached_requests[0])] == [([tokens[0]], [], 10, 1), ([tokens[1]], [], 11, 1)]
    finished = [d for _, _, m, d in log.entries if m == "request_finished"]
    assert finished == [(rid, calls["update_state_after_alloc"][1])]


def test_overlap_scheduler_reports_generation_steps_one_token_late():
    """Phase 2 must tolerate this: computed_position goes back by one after the context pass."""
    log = CallLog()
    spec = RequestSpec("one", random_tokens((1,), 10, 1000), max_new_tokens=3)
    run(config=DriverConfig(geometry=GEOMETRY, num_blocks=40, overlap_scheduler=True),
        connectors=recompute_only(log), workload=Sequential([spec]))
    outputs = [d for _, _, m, d in log.entries if m == "build_connector_meta"]
    assert [(c.cached_requests[0].new_tokens == [], c.cached_requests[0].computed_position) for c in outputs[1:]] == \
        [(True, 9), (False, 10)]


@pytest.mark.parametrize("load_async, save_async", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("overlap", [False, True])
def test_offloaded_blocks_come_back_bit_exact(baseline, load_async, save_async, overlap):
    store = InMemoryBlockStore()
    config = DriverConfig(geometry=GEOMETRY, num_blocks=40, overlap_scheduler=overlap)
    report = run(config, store_connector(store, load_async=load_async, save_async=save_async))
    assert report.outputs() == baseline
    assert report.stats.connector_matched_tokens > 0 and report.stats.onboarded_blocks > 0
    assert (report.stats.async_loads > 0) == load_async and (report.stats.delayed_frees > 0) == save_async


def test_negative_control_a_corrupting_load_fails_the_byte_check():
    with pytest.raises(KvMismatchError, match=r"1 of \d+ held positions differ.*connector-loaded"):
        run(connectors=store_connector(InMemoryBlockStore(), corrupt=True))


def test_delayed_free_is_honoured_and_freeing_early_is_caught():
    report = run(CONFIG, store_connector(InMemoryBlockStore(), save_async=True), prefix_then_extension())
    b = report.results["b"]
    assert (b.device_matched_tokens, b.connector_matched_tokens) == (0, 20) and report.stats.delayed_frees >= 1
    early = DriverConfig(geometry=GEOMETRY, num_blocks=40, honour_delayed_free=False)
    with pytest.raises(KvMismatchError, match="request b: .*connector-loaded.*poison"):
        run(early, store_connector(InMemoryBlockStore(), save_async=True), prefix_then_extension())


def test_different_salts_never_share_and_sharing_would_be_caught():
    report = run(CONFIG, store_connector(InMemoryBlockStore()), prefix_then_extension("globex"))
    b = report.results["b"]
    assert (b.device_matched_tokens, b.connector_matched_tokens) == (0, 0)
    assert report.results["a0"].connector_matched_tokens == 20, "the prefix was there for its own salt"
    with pytest.raises(KvMismatchError, match="request b: .*connector-loaded"):
        run(CONFIG, store_connector(InMemoryBlockStore(), ignore_salt=True), prefix_then_extension("globex"))


def test_with_block_reuse_off_the_connector_is_never_asked():
    """TensorRT-LLM's addSequence without reuse ignores the connector (but the rest is called)."""
    log = CallLog()
    run(DriverConfig(geometry=GEOMETRY, num_blocks=40, enable_block_reuse=False), recompute_only(log),
        prefix_then_extension())
    methods = log.methods("scheduler")
    assert "get_num_new_matched_tokens" not in methods
    assert methods.count("update_state_after_alloc") == 10 and "build_connector_meta" in methods


def test_a_hook_that_raises_fails_the_active_requests_and_a_retry_recomputes(baseline):
    config = DriverConfig(geometry=GEOMETRY, num_blocks=40, max_retries=1)
    report = run(config, recompute_only(worker=RaisingConnectorWorker, on_pass=5))
    assert report.stats.failed_attempts == 2 and all(r.error for r in report.failed_attempts)
    assert report.outputs() == baseline
    no_retry = run(CONFIG, recompute_only(worker=RaisingConnectorWorker, on_pass=5))
    assert sum(r.error is not None for r in no_retry.results.values()) == 2


def test_a_raising_start_load_kv_ends_the_run_like_tensorrt_llm():
    with pytest.raises(ConnectionError):
        run(connectors=recompute_only(worker=RaisingConnectorWorker, method="start_load_kv", on_pass=3))


def test_claiming_the_whole_prompt_is_rejected():
    class Greedy(RecomputeOnlyConnectorScheduler):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return request.prompt_len - num_computed_tokens, False

    with pytest.raises(RuntimeError, match="at least one uncomputed token"):
        run(connectors=ConnectorFactories(Greedy, RecomputeOnlyConnectorWorker))


def test_a_load_that_never_finishes_is_reported_as_a_stall():
    class Withholding(StoreConnectorWorker):
        def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
            return super().get_finished(finished_gen_req_ids, [])[0], []

    store = InMemoryBlockStore()
    factories = store_connector(store, load_async=True)
    factories = ConnectorFactories(factories.scheduler, partial(Withholding, store=store))
    config = DriverConfig(geometry=GEOMETRY, num_blocks=40, stall_timeout_s=0.3)
    with pytest.raises(DriverStallError, match="DISAGG_GENERATION_TRANS_IN_PROGRESS"):
        run(config, factories, prefix_then_extension())


def test_tensor_parallel_ranks_each_register_their_shard_and_bind_their_own_metadata():
    geometry = KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8, tokens_per_block=4, tp_size=2)
    config = DriverConfig(geometry=geometry, num_blocks=40)
    plain = run(config).outputs()
    store = InMemoryBlockStore(world_size=2)
    with Driver(config, store_connector(store)) as driver:
        report = driver.run(chats())
        workers = driver.runtime.workers
        assert [tuple(w.kv.shape) for w in workers] == [(40, 2, 2, 2 * 4 * 8)] * 2
        assert workers[0].get_connector_meta() is not workers[1].get_connector_meta()
    assert report.outputs() == plain and report.stats.onboarded_blocks > 0


def test_chunked_prefill_gives_the_same_tokens(baseline):
    config = DriverConfig(geometry=GEOMETRY, num_blocks=40, max_num_tokens=12, enable_chunked_prefill=True)
    report = run(config, store_connector(InMemoryBlockStore()))
    assert report.outputs() == baseline and report.stats.onboarded_blocks > 0


def test_a_request_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="more blocks than the pool"):
        run(workload=Sequential([RequestSpec("big", tuple(range(200)), 4)]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_same_driver_on_cuda_tensors(baseline):
    config = DriverConfig(geometry=GEOMETRY, num_blocks=40, device="cuda:0")
    report = run(config, store_connector(InMemoryBlockStore(), load_async=True, save_async=True))
    assert report.outputs() == baseline and report.stats.onboarded_blocks > 0
