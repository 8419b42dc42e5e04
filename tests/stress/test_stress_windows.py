"""Windows where kvbm can hand wrong KV to the engine (issue 17), one test each.

Each test exposes its window against real daemons (and the real vLLM engine where the
window is in the engine's use of a block), and is marked ``xfail(strict=True)`` with the fix
that closes it: when the fix lands the test passes, strict xfail fails, and the mark goes.
The fixes are described in ``tests/stress/README.md`` (section "Windows").

Slow copies are made with ``faulty_worker.py``'s ``KVBM_STRESS_STALL`` (a copy accepted in
time that sleeps on its lane thread before copying, as behind a stalled disk or a stopped
process), which widens each window deterministically instead of waiting for a SIGSTOP to
land inside a copy of a few milliseconds.
"""
from __future__ import annotations

import hashlib
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from kvbm_client import KvbmClient, KvbmConfig, ShmKvBuffer
from kvbm_client.contract import pb, rpc

from .harness import EngineConfig, Run, differing, run_baseline
from .node import Daemon, NodeConfig
from .workload import Request, Wave, Workload

BS = 16  # tokens per block in the scheduler-role tests (any size works there)


# ---------------------------------------------------------------------------- stand-ins
# The scheduler role is driven through vLLM's hooks with stand-ins of vLLM's objects (it
# reads only these attributes); the leader, the worker and the copies are real.

def vllm_request(req_id: str, hashes: list[bytes], num_tokens: int, num_computed_tokens: int = 0):
    return SimpleNamespace(request_id=req_id, block_hashes=hashes, num_tokens=num_tokens,
                           num_computed_tokens=num_computed_tokens)


def vllm_blocks(block_ids: list[int]):
    return SimpleNamespace(get_block_ids=lambda: (list(block_ids),))


def scheduler_output(new: dict[str, list[int]], scheduled: dict[str, int]):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,)) for r, ids in new.items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens=scheduled, preempted_req_ids=set())


def block_hashes(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}block{i}".encode()).digest() for i in range(n)]


def transfer(node, region_id: str, spec, timeout: float = 30.0):
    """The worker role's call for a load or store spec (it joins an early call of the same plan)."""
    with grpc.insecure_channel(f"unix:{node.root / 'sock' / 'worker-0.sock'}") as channel:
        return rpc.WorkerStub(channel).Transfer(pb.TransferRequest(
            region_id=region_id, plan=pb.SignedPlan(plan=spec.plan, signature=spec.signature),
            engine_blocks=spec.engine_blocks), timeout=timeout)


@pytest.fixture
def engine_buffer(tmp_path):
    buf = ShmKvBuffer(num_blocks=32, num_layers=2, page_bytes=4096, directory=str(tmp_path))
    buf.array[:] = np.random.default_rng(0).integers(0, 256, buf.array.shape, dtype=np.uint8)
    yield buf
    buf.close()


# ---------------------------------------------------------------------------- window 1
@pytest.mark.xfail(strict=True, reason="issue 17 window 1: a load planned for one local prefix is sent after "
                   "vLLM asked again with another (get_num_new_matched_tokens returns the old plan's size); "
                   "fix: re-plan when num_computed_tokens changed (README 'Windows' 1)")
def test_load_lands_where_vllm_counts_the_external_tokens(stress_node, engine_buffer):
    """vLLM asks ``get_num_new_matched_tokens`` again each step a request waits for G1 space,
    and the local prefix it passes changes when G1 evicts or computes blocks meanwhile. The
    blocks loaded must be the ones vLLM then counts as external: ``[computed, computed + n)``
    of the call it acted on. Seen in the stress run: 3 of 48 outputs differed from token 0."""
    from kvbm_client.connectors.vllm.scheduler import KvbmConnectorScheduler
    from kvbm_client.connectors.vllm.settings import ConnectorSettings

    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0))
    client = KvbmClient(KvbmConfig.from_env(node.env), client_name="stand-in-engine")
    try:
        region_id = client.register_region("0", engine_buffer.spec())
        client.wait_ready(30)
        sched = KvbmConnectorScheduler(BS, ConnectorSettings.from_extra(
            {"socket_dir": node.env["DYN_KVBM_SOCKET_DIR"]}, "windows"), ["0"])
        hashes = block_hashes(7)
        # A first request computes 6 blocks in engine blocks 0..5; the connector stores them.
        first = vllm_request("first", hashes[:6], 6 * BS + 1)
        assert sched.get_num_new_matched_tokens(first, 0) == (0, False)
        sched.update_state_after_alloc(first, vllm_blocks(list(range(7))), 0)
        meta = sched.build_connector_meta(scheduler_output({"first": list(range(7))}, {"first": 6 * BS + 1}))
        assert len(meta.stores) == 1
        transfer(node, region_id, meta.stores[0])
        sched.request_finished(first, list(range(7)))
        # The second request shares those 6 blocks. vLLM asks with 3 of them still in G1 ...
        second = vllm_request("second", hashes, 7 * BS + 5)
        assert sched.get_num_new_matched_tokens(second, 3 * BS) == (3 * BS, False)
        # ... cannot allocate, G1 evicts those 3 meanwhile, and vLLM asks again from 0.
        external, _ = sched.get_num_new_matched_tokens(second, 0)
        table = list(range(20, 28))
        sched.update_state_after_alloc(second, vllm_blocks(table), external)
        meta = sched.build_connector_meta(scheduler_output({"second": table}, {"second": 7 * BS + 5 - external}))
        assert [len(s.engine_blocks) for s in meta.loads] == [external // BS]
        transfer(node, region_id, meta.loads[0])
        for i in range(external // BS):  # vLLM treats positions [0, external) as loaded
            assert np.array_equal(engine_buffer.array[table[i]], engine_buffer.array[i]), \
                f"block {i} of the prefix (engine block {table[i]}) is not what was stored; the load went to " \
                f"engine blocks {meta.loads[0].engine_blocks}"
        sched.shutdown()
    finally:
        client.close()


# ---------------------------------------------------------------------------- window 5
@pytest.mark.xfail(strict=True, reason="issue 17 window 5: after a leader restart, a copy of the old leader's "
                   "job reports its job id to the new leader, which confirms its own job of that id before "
                   "that job copied; fix: CompleteTransfer names leader id and epoch, the worker drains old-epoch "
                   "copies before PoolsReady (README 'Windows' 5)")
def test_old_leaders_report_does_not_confirm_a_new_job(stress_node, engine_buffer):
    """Job ids restart at 1 with a new leader, and CompleteTransfer carries only the id: the
    first leader's job 1 (stalled 15 s on the store lane) reports "job 1 ok" to the new leader,
    whose own job 1 (queued behind it, then stalled 8 s) is confirmed before it copied."""
    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0, worker_faults=(("KVBM_STRESS_STALL",
                                                                             "store:1:15,store:2:8"),)))
    client = KvbmClient(KvbmConfig.from_env(node.env), client_name="stand-in-engine")
    try:
        client.register_region("0", engine_buffer.spec())
        client.wait_ready(30)
        old_keys = [hashlib.blake2b(h, digest_size=16).digest() for h in block_hashes(4, "old")]
        new_keys = [hashlib.blake2b(h, digest_size=16).digest() for h in block_hashes(4, "new")]
        client.offload(old_keys, [0, 1, 2, 3])  # job 1 of the first leader
        t0 = time.monotonic()
        time.sleep(0.5)
        node.kill(Daemon.LEADER)
        node.restart(Daemon.LEADER)
        node.wait_ready(30)
        client.wait_ready(30)  # the session of the dead leader is re-opened
        handle = client.offload(new_keys, [4, 5, 6, 7])  # job 1 of the new leader
        time.sleep(max(0.0, 15.5 - (time.monotonic() - t0)))  # the old job has copied and reported
        load = client.onboard(new_keys, [10, 11, 12, 13])
        client.wait(load)
        n = load.num_blocks
        assert np.array_equal(engine_buffer.array[10:10 + n], engine_buffer.array[4:4 + n]), \
            f"{n} blocks served for the new keys hold other bytes (the old leader's job wrote them)"
        client.wait(handle)
        load = client.onboard(new_keys, [14, 15, 16, 17])
        client.wait(load)
        assert load.num_blocks == 4 and np.array_equal(engine_buffer.array[14:18], engine_buffer.array[4:8])
    finally:
        client.close()


# ---------------------------------------------------------------------------- recovery after a leader restart
@pytest.mark.xfail(strict=True, reason="kill-leader pass: a store the new leader does not confirm is answered "
                   "UNAVAILABLE, the worker role takes it for a lost daemon and re-registers, and the daemon refuses "
                   "the same pid (ALREADY_EXISTS) forever: no kvbm until the engine restarts; fix: ABORTED for an "
                   "unconfirmed store, RegisterRegion idempotent for the same pid and layout (README 'Windows')")
def test_worker_role_keeps_its_region_after_a_leader_restart(stress_node, engine_buffer):
    from kvbm_client.connectors.vllm.scheduler import KvbmConnectorScheduler
    from kvbm_client.connectors.vllm.settings import ConnectorSettings
    from kvbm_client.connectors.vllm.worker import KvbmConnectorWorker

    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0, worker_faults=(("KVBM_STRESS_STALL", "store:1:4"),)))
    settings = ConnectorSettings.from_extra({"socket_dir": node.env["DYN_KVBM_SOCKET_DIR"], "retry_s": 0.5},
                                            "windows")
    worker = KvbmConnectorWorker("0", settings)
    sched = KvbmConnectorScheduler(BS, settings, ["0"])
    try:
        worker.set_region(engine_buffer.spec())  # the worker role registers the engine's KV cache
        assert worker.region_id is not None
        node.wait_ready(30)
        req = vllm_request("r", block_hashes(4), 4 * BS + 1)
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, vllm_blocks(list(range(5))), 0)
        meta = sched.build_connector_meta(scheduler_output({"r": list(range(5))}, {"r": 4 * BS + 1}))
        worker.start_stores(meta)  # the copy sleeps 4 s on the store lane
        node.kill(Daemon.LEADER)
        node.restart(Daemon.LEADER)
        node.wait_ready(30)
        worker.fence_stores()  # the store fails: the new leader does not know its job
        end = time.monotonic() + 10
        while worker.region_id is None and time.monotonic() < end:
            time.sleep(0.2)
        assert worker.region_id is not None, "the worker role lost its region and cannot register it again"
    finally:
        sched.shutdown()
        worker.shutdown()


# ---------------------------------------------------------------------------- window 6
@pytest.mark.xfail(strict=True, reason="issue 17 window 6: the worker checks a plan's deadline when the Transfer "
                   "arrives, not when its lane starts the copy; a load queued past its job's expiry copies slots the "
                   "leader gave to other blocks and reports success; fix: check the deadline on the lane, keep the "
                   "slots of an unreported job until its report (README 'Windows' 6)")
def test_load_that_starts_after_its_deadline_fails(stress_node, engine_buffer):
    node = stress_node(NodeConfig(g2_blocks=4, g3_blocks=0, job_timeout_s=2.0,
                                  worker_faults=(("KVBM_STRESS_STALL", "load:1:6"),)))
    client = KvbmClient(KvbmConfig.from_env(node.env), client_name="stand-in-engine")
    try:
        client.register_region("0", engine_buffer.spec())
        client.wait_ready(30)
        first = [hashlib.blake2b(h, digest_size=16).digest() for h in block_hashes(4, "first")]
        second = [hashlib.blake2b(h, digest_size=16).digest() for h in block_hashes(4, "second")]
        client.wait(client.offload(first, [0, 1, 2, 3]))
        t0 = time.monotonic()
        load = client.onboard(first, [10, 11, 12, 13])  # accepted at once, sleeps 6 s on the load lane
        assert load.num_blocks == 4
        time.sleep(4.5)  # the job expired at 2 + 2 s: its pins are gone, G2 is full of evictable blocks
        client.wait(client.offload(second, [4, 5, 6, 7]))  # evicts `first`, writes the same 4 slots
        assert time.monotonic() - t0 < 6, "precondition: the second store must land before the stalled load copies"
        try:
            client.wait(load)
        except Exception:
            return  # refused or failed: the engine recomputes, nothing wrong was served
        assert np.array_equal(engine_buffer.array[10:14], engine_buffer.array[0:4]), \
            "a load reported success with another block's bytes"
    finally:
        client.close()


# ---------------------------------------------------------------------------- windows 2 and 3 (engine)
def _prompt(seed: int, n: int) -> list[int]:
    rnd = np.random.default_rng(seed)
    return [int(x) for x in rnd.integers(10, 1000, n)]


def _a_and_again(again_max_tokens: int) -> tuple[Request, Request]:
    """Request A (5 full blocks) and a later one sharing those 5 blocks."""
    a = _prompt(1, 5 * 32 + 10)
    return Request("A", a, 4), Request("A-again", a[:5 * 32] + _prompt(2, 40), again_max_tokens)


def _assert_identical_after(out: dict, fallback: str) -> None:
    """The connector did give up on the slow copy (``fallback`` counted in the engine log), and
    no output differs from vLLM alone."""
    assert out["result"]["engine_log"][fallback] >= 1, f"no {fallback}: the connector never gave up on the copy"
    assert out["differing"] == []


def _engine_window(stress_model, stress_node, tmp_path, workload: Workload, fault: tuple[str, str]) -> dict:
    """Serve ``workload`` through kvbm with one worker fault (a faulty_worker.py variable and
    its value); compare with vLLM alone."""
    engine = EngineConfig(g1_bytes=3 << 20, max_num_seqs=8, max_model_len=640)
    baseline = run_baseline(stress_model, workload, engine, tmp_path / "baseline")
    node = stress_node(NodeConfig(g2_blocks=256, g3_blocks=0, worker_faults=(fault,)))
    run = Run(stress_model, workload.write(tmp_path / "workload.json"), tmp_path / "kvbm.json", engine, kvbm=True,
              env={"DYN_KVBM_SOCKET_DIR": node.env["DYN_KVBM_SOCKET_DIR"]}, timeout_s=600)
    result = run.finish(run.start())
    assert node.injected_faults(), "the fault was not injected: the window was not opened"
    return {"differing": differing(baseline, result), "result": result, "node": node}


@pytest.mark.timeout(900)
@pytest.mark.xfail(strict=True, reason="issue 17 window 2: the connector gives a block back to vLLM when its "
                   "30 s wait for a store expires, the copy still reads it later, and the leader accepts the late "
                   "report (before deadline + grace); fix: the leader refuses a STORE report after the plan's "
                   "deadline and the worker checks the deadline on the lane (README 'Windows' 2)")
def test_store_copy_outliving_the_connector_wait_is_never_served(stress_model, stress_node, tmp_path):
    """Request A's first store sleeps 36 s on the worker's store lane. The connector waits 30 s,
    frees A's blocks, and other requests write their KV there; then the copy reads them and
    is committed under A's hashes. A later request with A's prefix loads it."""
    others = [Request(f"B{i}", _prompt(100 + i, 170), 24) for i in range(12)]
    a, again = _a_and_again(again_max_tokens=8)
    workload = Workload([a, again, *others], [Wave(["A"]), Wave([r.id for r in others]), Wave(["A-again"])])
    out = _engine_window(stress_model, stress_node, tmp_path, workload, ("KVBM_STRESS_STALL", "store:1:36"))
    _assert_identical_after(out, "stores_failed")


@pytest.mark.timeout(900)
@pytest.mark.xfail(strict=True, reason="issue 17 window 3: a load the connector gave up on after 30 s is still "
                   "copied later, into engine blocks vLLM has given to other requests; fix: the worker refuses to "
                   "start a copy past the plan's deadline and the connector keeps the blocks of an unanswered "
                   "load out of vLLM's pool (README 'Windows' 3)")
def test_load_copy_outliving_the_connector_wait_never_lands(stress_model, stress_node, tmp_path):
    """A's prefix comes back from kvbm, but the copy sleeps 36 s on the load lane. The connector
    waits 30 s, reports a load error (vLLM recomputes), A finishes, its blocks go to C requests;
    then the copy writes A's bytes into them."""
    evict = [Request(f"E{i}", _prompt(200 + i, 170), 8) for i in range(6)]
    victims = [Request(f"C{i}", _prompt(300 + i, 64), 120) for i in range(12)]
    a, again = _a_and_again(again_max_tokens=4)
    workload = Workload([a, again, *evict, *victims], [Wave(["A"]), Wave([r.id for r in evict]),
                                                       Wave(["A-again"] + [r.id for r in victims])])
    out = _engine_window(stress_model, stress_node, tmp_path, workload, ("KVBM_STRESS_STALL", "load:1:36"))
    _assert_identical_after(out, "loads_failed")


# ---------------------------------------------------------------------------- window 7 (engine)
@pytest.mark.timeout(900)
@pytest.mark.xfail(strict=True, reason="issue 17 window 7: a step whose synchronous load failed still stores "
                   "the blocks it computed after the unloaded ones (their KV read the unloaded blocks); vLLM "
                   "recomputes them, kvbm keeps the wrong copy; fix: the worker role drops the step's store plans "
                   "when a sync load of the step failed (README 'Windows' 7)")
def test_blocks_computed_over_a_failed_load_are_never_stored(stress_model, stress_node, tmp_path):
    """A2's prefix (6 blocks) comes from kvbm but the load fails; the same step computes A2's
    blocks 6..8 over the unloaded ones and stores them. A3 shares A2's 9 blocks and loads them."""
    a = _prompt(1, 6 * 32 + 10)
    a2 = a[:6 * 32] + _prompt(3, 3 * 32) + _prompt(4, 10)
    a3 = a2[:9 * 32] + _prompt(5, 20)
    evict = [Request(f"E{i}", _prompt(200 + i, 170), 8) for i in range(12)]
    requests = [Request("A", a, 4), Request("A2", a2, 4), Request("A3", a3, 8), *evict]
    workload = Workload(requests, [Wave(["A"]), Wave([f"E{i}" for i in range(6)]), Wave(["A2"]),
                                   Wave([f"E{i}" for i in range(6, 12)]), Wave(["A3"])])
    out = _engine_window(stress_model, stress_node, tmp_path, workload, ("KVBM_STRESS_FAIL", "load:1"))
    assert out["result"]["engine_log"]["loads_failed"] >= 1, "A2's load did not fail"
    assert out["result"]["records"]["A3"]["cached"] >= 6 * 32, "A3's prefix did not come back from kvbm"
    assert out["differing"] == []
