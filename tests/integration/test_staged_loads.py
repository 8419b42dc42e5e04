"""Staged loads (``TransferRequest.stage``, ``kvbm-worker --stage-mib``) on the real daemons: a
load's leading layer groups are copied into the worker's staging area before the engine's
blocks are known, and the call that names the blocks lands them from there; every refusal
moves nothing, and a stage never leaves the node serving bytes it cannot vouch for."""
from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from kvbm_client.channels import open_channel
from kvbm_client.contract import pb, rpc
from kvbm_client.errors import KvbmRequestError
from kvbm_client.ids import WorkerId
from kvbm_client.leader_session import LeaderSession, StageAsk
from support.fault_env import fault_env
from test_layerwise_loads import LAYERS, PAGE, Setup, hashes

N = 6  # blocks of Setup's load
FIRST = N * 4 * PAGE  # the first of 4 front-loaded groups (pages 0..3) of every block
STAGE_SMALL = ("--stage-mib", str(FIRST / (1 << 20)))  # room for that group only
STAGE_LARGE = ("--stage-mib", "1")  # room for every group: a stage still takes the first only (stages.MAX_STAGED_GROUPS)


def stage(s: Setup, groups: int = 4, plan=None, **fields) -> "pb.TransferResponse":
    request = _stage_request(s, groups, plan)
    for name, value in fields.items():
        if name == "engine_blocks":
            request.engine_blocks.extend(value)
        else:
            setattr(request, name, value)
    return s.stub.Transfer(request, timeout=10)


def _stage_request(s: Setup, groups: int = 4, plan=None) -> "pb.TransferRequest":
    request = s.request([], groups, plan)
    request.stage = True
    return request


def counters(s: Setup) -> dict[str, float]:
    return dict(s.stub.Status(pb.WorkerStatusRequest(), timeout=5).counters)


def refused(call, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    assert words in err.value.details(), err.value.details()


@pytest.mark.parametrize("area", [STAGE_SMALL, STAGE_LARGE])
def test_a_staged_load_lands_its_first_group_from_the_area(make_node, area):
    s = Setup(make_node(worker_args=area))
    dst = [40, 41, 42, 43, 44, 45]
    s.array[dst] = 0
    answer = stage(s)
    assert answer.bytes == FIRST and answer.job_id == pb.TransferPlan.FromString(s.load.signed.plan).job_id
    assert not s.array[dst].any(), "a stage wrote into the engine before its blocks were named"
    messages = list(s.stub.TransferLayers(s.request(dst, 4), timeout=20))
    assert messages[-1].HasField("done") and messages[-1].done.bytes == N * LAYERS * PAGE
    assert [m.pages_landed for m in messages][-1] == LAYERS
    assert np.array_equal(s.array[dst], s.array[0:6])
    c = counters(s)
    assert c["loads_staged"] == 1 and c["staged_loads_used"] == 1 and c["jobs_ok"] >= 1
    log = s.node.log_tails(chars=1 << 20)
    assert f"job {answer.job_id} load: staged" in log
    assert f"staging area: {float(area[1]):g} MiB in host memory (--stage-mib;" in log


def test_the_worker_side_joins_the_staged_job(make_node):
    """The scheduler side stages, then starts the load early with the blocks; the worker side's
    own call joins that job (the three calls the vLLM connector makes)."""
    s = Setup(make_node(worker_args=STAGE_SMALL))
    dst = [30, 31, 32, 33, 34, 35]
    s.array[dst] = 0
    stage(s)
    early = s.stub.Transfer.future(s.request(dst, 4), timeout=10)
    messages = list(s.stub.TransferLayers(s.request(dst, 4), timeout=10))
    assert early.result().bytes == messages[-1].done.bytes == N * LAYERS * PAGE
    assert messages[-1].done.joined or early.result().joined
    assert np.array_equal(s.array[dst], s.array[0:6])
    assert counters(s)["staged_loads_used"] == 1


def test_stage_refusals_move_nothing(make_node):
    s = Setup(make_node(worker_args=STAGE_SMALL))
    dst = [50, 51, 52, 53, 54, 55]
    s.array[dst] = 0
    before = counters(s)
    refused(lambda: stage(s, groups=1), grpc.StatusCode.FAILED_PRECONDITION, "layer_groups >= 2")
    refused(lambda: stage(s, engine_blocks=dst), grpc.StatusCode.INVALID_ARGUMENT, "names no engine blocks")
    refused(lambda: stage(s, signal_slot=1), grpc.StatusCode.INVALID_ARGUMENT, "names no engine blocks")
    store = s.session.prepare_store(hashes(2, seed=5))
    refused(lambda: stage(s, plan=store.signed), grpc.StatusCode.INVALID_ARGUMENT, "only a load is staged")
    forged = pb.TransferPlan.FromString(s.load.signed.plan)
    forged.job_id += 1000
    refused(lambda: stage(s, plan=pb.SignedPlan(plan=forged.SerializeToString(), signature=s.load.signed.signature)),
            grpc.StatusCode.PERMISSION_DENIED, "not signed")
    refused(lambda: stage(s, region_id="nope"), grpc.StatusCode.NOT_FOUND, "unknown region")
    request = _stage_request(s)
    refused(lambda: list(s.stub.TransferLayers(request, timeout=10)), grpc.StatusCode.INVALID_ARGUMENT,
            "a stage is a Transfer call")
    c = counters(s)
    assert c["loads_staged"] == 0 and c["jobs_ok"] == before["jobs_ok"]
    assert not s.array[dst].any()
    # the plan was never started by any of them: it still loads (unstaged: nothing was staged)
    s.stub.Transfer(s.request(dst, 4), timeout=10)
    assert np.array_equal(s.array[dst], s.array[0:6])


def test_a_worker_without_an_area_refuses_to_stage(make_node):
    s = Setup(make_node())
    refused(lambda: stage(s), grpc.StatusCode.FAILED_PRECONDITION, "no staging area")
    refused(lambda: stage(s), grpc.StatusCode.FAILED_PRECONDITION, "no staging area")
    told = [line for line in s.node.log_tails(chars=1 << 20).splitlines()
            if "asks to stage its loads (staged_loads), but this worker has no staging area" in line]
    assert len(told) == 1 and " INFO " in told[0], told  # the operator is told once, at info level


def test_one_staged_load_at_a_time_and_a_bad_bind_takes_nothing(make_node):
    s = Setup(make_node(worker_args=STAGE_SMALL))
    other = s.session.prepare_load(hashes(N))  # a second plan of the same blocks
    stage(s)
    refused(lambda: stage(s, plan=other.signed), grpc.StatusCode.FAILED_PRECONDITION, "holds another load")
    # a call of the staged plan that fails its checks takes nothing: the stage stays for the right one
    refused(lambda: s.stub.Transfer(s.request([999] * N, 4), timeout=10), grpc.StatusCode.OUT_OF_RANGE, "engine block")
    dst = [20, 21, 22, 23, 24, 25]
    s.array[dst] = 0
    s.stub.Transfer(s.request(dst, 4), timeout=10)
    assert np.array_equal(s.array[dst], s.array[0:6])
    assert counters(s)["staged_loads_used"] == 1
    stage(s, plan=other.signed)  # the area is free again once its load was taken
    # a stage of a job that has started is refused
    refused(lambda: stage(s), grpc.StatusCode.FAILED_PRECONDITION, "its job has started")


def test_a_stage_not_taken_within_its_hold_frees_the_area(make_node):
    s = Setup(make_node(worker_args=STAGE_SMALL))
    other = s.session.prepare_load(hashes(N))
    stage(s)
    time.sleep(1.2)  # STAGE_HOLD_S
    stage(s, plan=other.signed)  # claims the area the first left
    dst = [10, 11, 12, 13, 14, 15]
    s.array[dst] = 0
    s.stub.Transfer(s.request(dst, 4), timeout=10)  # the first plan: its stage is gone, every group copied
    assert np.array_equal(s.array[dst], s.array[0:6])
    assert counters(s)["staged_loads_used"] == 0
    dst = [16, 17, 18, 19, 20, 21]
    s.array[dst] = 0
    s.stub.Transfer(s.request(dst, 4, plan=other.signed), timeout=10)
    assert np.array_equal(s.array[dst], s.array[0:6])
    assert counters(s)["staged_loads_used"] == 1


def test_a_call_in_other_layer_groups_copies_every_group(make_node):
    s = Setup(make_node(worker_args=STAGE_LARGE))
    stage(s, groups=4)
    dst = [46, 47, 48, 49, 50, 51]
    s.array[dst] = 0
    s.stub.Transfer(s.request(dst, 2), timeout=10)
    assert np.array_equal(s.array[dst], s.array[0:6])
    assert counters(s)["staged_loads_used"] == 0
    assert "staged in other layer groups" in s.node.log_tails(chars=1 << 20)


def test_each_worker_stages_its_own_shard(make_node):
    """Tensor parallelism: the scheduler side sends the stage to every worker; each stages its
    own shard of the plan and lands it in its own engine's blocks."""
    node = make_node(num_workers=2, worker_args=STAGE_SMALL)
    client, engines = node.ready_client(num_layers=LAYERS, page_bytes=PAGE)
    keys = hashes(N)
    client.wait(client.offload(keys, list(range(N))))
    with LeaderSession(node.leader_address, timeout=5) as session:
        load = session.prepare_load(keys)
        signed = pb.SignedPlan(plan=load.signed.plan, signature=load.signed.signature)
        dst = [40, 41, 42, 43, 44, 45]
        for w in ("0", "1"):
            stub = rpc.WorkerStub(open_channel(node.config().worker_address(w), node.config()))
            engines[w].array[dst] = 0
            region = client.region_id(w)
            assert stub.Transfer(pb.TransferRequest(region_id=region, plan=signed, layer_groups=4, stage=True),
                                 timeout=10).bytes == FIRST
            stub.Transfer(pb.TransferRequest(region_id=region, plan=signed, engine_blocks=dst, layer_groups=4),
                          timeout=10)
            assert np.array_equal(engines[w].array[dst], engines[w].array[0:6]), f"worker {w}"
            assert dict(stub.Status(pb.WorkerStatusRequest(), timeout=5).counters)["staged_loads_used"] == 1


def wait_counter(stub, name: str, value: float, timeout: float = 5.0) -> dict[str, float]:
    """The worker's counters once ``name`` reached ``value`` (the leader's stages run in the background)."""
    end = time.monotonic() + timeout
    while True:
        c = dict(stub.Status(pb.WorkerStatusRequest(), timeout=5).counters)
        if c[name] >= value or time.monotonic() > end:
            return c
        time.sleep(0.02)


def test_the_leader_stages_a_lookup_on_every_named_worker(make_node):
    """``PrepareLoadRequest.stage``: the leader sends the signed plan to each named worker on its
    attach stream before it answers; each stages its own shard, and the call that names the
    blocks lands it from the area (tensor parallelism: two workers)."""
    node = make_node(num_workers=2, worker_args=STAGE_SMALL)
    client, engines = node.ready_client(num_layers=LAYERS, page_bytes=PAGE)
    keys = hashes(N)
    client.wait(client.offload(keys, list(range(N))))
    regions = {w: client.region_id(w) for w in ("0", "1")}
    stubs = {w: rpc.WorkerStub(open_channel(node.config().worker_address(w), node.config())) for w in regions}
    with LeaderSession(node.leader_address, timeout=5) as session:
        load = session.prepare_load(keys, stage=StageAsk(4, tuple((WorkerId(w), r) for w, r in regions.items())))
        assert load.num_blocks == N
        signed = pb.SignedPlan(plan=load.signed.plan, signature=load.signed.signature)
        dst = [40, 41, 42, 43, 44, 45]
        for w, stub in stubs.items():
            engines[w].array[dst] = 0
            assert wait_counter(stub, "loads_staged", 1)["loads_staged"] == 1, f"worker {w} staged nothing"
            assert not engines[w].array[dst].any(), "a stage wrote into the engine before its blocks were named"
            messages = list(stub.TransferLayers(pb.TransferRequest(region_id=regions[w], plan=signed,
                                                                   engine_blocks=dst, layer_groups=4), timeout=10))
            assert messages[-1].done.bytes == N * LAYERS * PAGE
            assert np.array_equal(engines[w].array[dst], engines[w].array[0:6]), f"worker {w}"
            assert wait_counter(stub, "staged_loads_used", 1)["staged_loads_used"] == 1
    log = node.log_tails(chars=1 << 20)
    assert f"job {load.job_id} load: stage of 4 layer groups sent to worker(s) 0,1" in log
    assert log.count(f"job {load.job_id} load: staged 1 of 4 layer groups") == 2


def test_a_lookup_stage_out_of_bounds_plans_nothing(make_node):
    s = Setup(make_node(worker_args=STAGE_SMALL))
    keys = hashes(N)
    ok = (WorkerId("0"), s.region_id)
    for stage, words in ((StageAsk(1, (ok,)), "layer_groups=1"), (StageAsk(65, (ok,)), "layer_groups=65"),
                         (StageAsk(4, ()), "0 targets"), (StageAsk(4, (ok, ok)), "names worker '0' twice"),
                         (StageAsk(4, ((WorkerId("0"), ""),)), "names no region"),
                         (StageAsk(4, ((WorkerId("0"), "r" * 300),)), "region_id of 300 bytes")):
        with pytest.raises(KvbmRequestError) as err:
            s.session.prepare_load(keys, stage=stage)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in str(err.value), str(err.value)
    time.sleep(0.3)
    assert counters(s)["loads_staged"] == 0
    # nothing was pinned by the refused lookups: the blocks are still evictable (the plan of
    # Setup holds them) and a lookup without a stage plans them
    assert s.session.prepare_load(keys).num_blocks == N


def test_a_lookup_stage_to_a_missing_worker_or_region_only_costs_the_stage(make_node):
    s = Setup(make_node(worker_args=STAGE_SMALL))
    keys = hashes(N)
    load = s.session.prepare_load(keys, stage=StageAsk(4, ((WorkerId("7"), s.region_id), (WorkerId("0"), "nope"))))
    assert load.num_blocks == N
    dst = [30, 31, 32, 33, 34, 35]
    s.array[dst] = 0
    s.stub.Transfer(s.request(dst, 4, plan=load.signed), timeout=10)
    assert np.array_equal(s.array[dst], s.array[0:6])
    c = counters(s)
    assert c["loads_staged"] == 0 and c["staged_loads_used"] == 0
    log = s.node.log_tails(chars=1 << 20)
    assert f"job {load.job_id} load: stage of 4 layer groups sent to worker(s) 0 (not attached: 7)" in log
    assert "stage sent by the leader refused: unknown region 'nope' (NOT_FOUND)" in log


def test_a_stage_whose_go_is_refused_is_never_used_and_frees_the_area(make_node):
    """The stage's copy starts before the leader's go; a plan released meanwhile (its slots may
    already hold other blocks) is refused its go: the stage fails, its bytes are never taken,
    and the area is free at once (no hold)."""
    s = Setup(make_node(worker_args=STAGE_SMALL))
    s.session.release(s.load)
    refused(lambda: stage(s), grpc.StatusCode.FAILED_PRECONDITION, "did not let it start")
    assert counters(s)["loads_staged"] == 0
    other = s.session.prepare_load(hashes(N))
    assert stage(s, plan=other.signed).bytes == FIRST  # the area was freed with the refusal
    refused(lambda: s.stub.Transfer(s.request([20, 21, 22, 23, 24, 25], 4), timeout=10),
            grpc.StatusCode.FAILED_PRECONDITION, "did not let it start")
    assert counters(s)["staged_loads_used"] == 0
    assert "not staged, job" in s.node.log_tails(chars=1 << 20)


def test_a_stage_copies_before_its_go_and_its_bind_waits_for_the_go(make_node):
    """A slow leader: the stage's copy into the area starts at once, its go comes 1 s later;
    the call that names the blocks, sent meanwhile, takes the staged groups only once the go came."""
    s = Setup(make_node(worker_args=STAGE_SMALL, **fault_env(GO_DELAY_SECS="1.0")))
    job = pb.TransferPlan.FromString(s.load.signed.plan).job_id
    dst = [40, 41, 42, 43, 44, 45]
    s.array[dst] = 0
    t0 = time.monotonic()
    staged = s.stub.Transfer.future(_stage_request(s), timeout=10)
    time.sleep(0.3)
    assert not staged.done(), "the stage answered before its go"
    messages = list(s.stub.TransferLayers(s.request(dst, 4), timeout=10))
    assert time.monotonic() - t0 >= 1.0, "the bind landed bytes before the stage's go"
    assert staged.result().bytes == FIRST and messages[-1].done.bytes == N * LAYERS * PAGE
    assert np.array_equal(s.array[dst], s.array[0:6])
    assert counters(s)["staged_loads_used"] == 1
    log = s.node.log_tails(chars=1 << 20)
    copy_started, bind_arrived = log.find(f"job {job} load: copy starts"), log.find(f"job {job} load: started")
    assert 0 <= copy_started < bind_arrived, "the stage's copy waited for its go"




@pytest.mark.parametrize("area", [True, False])
def test_the_scheduler_side_names_only_workers_with_an_area(make_node, caplog, area):
    """``EarlyLoads.stage_targets``: a worker is named once its Status says it has a staging area
    (asked in the background, never blocking the scheduler's thread); one without an area never."""
    from kvbm_client.connectors.core import EarlyLoads
    from kvbm_client.connectors.core.region_ids import EngineRegionIds
    from test_early_loads import ENGINE, settings as early_settings
    s = Setup(make_node(worker_args=STAGE_SMALL if area else ()))
    EngineRegionIds(s.node.config().resolved_socket_dir, ENGINE).publish("0", s.region_id)
    caplog.set_level("DEBUG", logger="kvbm.connector")
    early = EarlyLoads(early_settings(s.node), ["0"])
    try:
        assert early.stage_targets() == (), "named before the worker said it has an area"
        end = time.monotonic() + 5
        while early.stage_targets() == () and time.monotonic() < end and "staging area" not in caplog.text:
            time.sleep(0.02)
        assert early.stage_targets() == ((("0", s.region_id),) if area else ())
        assert ("stages loads" if area else "has no staging area") in caplog.text
    finally:
        early.close()
