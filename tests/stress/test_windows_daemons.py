"""Windows where kvbm could hand wrong KV to an engine (issue 17), one test each, against the
real leader and worker and the connector's real core (``core_engine.py``); no engine process.

Each test sets up the window deterministically with the test suite's fault wrapper
(``tests/support/faults``: a copy that stalls on its lane before its first byte, a copy that
stalls inside its first chunk, a copy that fails), then checks the invariant itself: the
bytes the engine treats as loaded are the stored ones, and no copy touches a block after the
engine may have handed it to another request. The ordering argument that closes them is in
``kvbm_client/connectors/core/__init__.py``; tests/stress/README.md ("Windows") tells which
fix closes which window.

The engine-level counterparts (real vLLM, slow) are in ``test_windows_engine.py``.
"""
from __future__ import annotations

import time
import zlib

import numpy as np
import pytest

from kvbm_client import KvbmClient, KvbmConfig

from .core_engine import BS, CoreEngine, Req, keys_of, tokens
from .node import Daemon, NodeConfig

pytestmark = pytest.mark.timeout(240)


def client_of(node) -> KvbmClient:
    return KvbmClient(KvbmConfig.from_env(node.env), client_name="stand-in-engine")


def keys(salt: str, n: int) -> list[bytes]:
    return keys_of(tokens(zlib.crc32(salt.encode()), n * BS))


# ---------------------------------------------------------------------------- window 1
def test_load_lands_where_the_engine_counts_the_external_tokens(stress_node, engine_buffer):
    """An engine asks ``lookup`` again each step a request waits for G1 space, and the local
    prefix it passes changes when G1 evicts or computes blocks meanwhile. The blocks loaded
    must be ``[computed, computed + n)`` of the call the engine acted on (found by the stress
    run without any fault: 3-6 of 48 outputs differed from their first token)."""
    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0))
    eng = CoreEngine(node, engine_buffer)
    try:
        prompt = tokens(1, 7 * BS + 5)
        eng.store(Req("first", prompt[:6 * BS + 1]), range(7))
        second = Req("second", prompt)
        assert eng.sched.lookup(second, 3 * BS) == (3 * BS, False), "3 of the 6 stored blocks are still local"
        table = list(range(20, 28))
        external = eng.schedule(second, table, 0)  # G1 evicted them meanwhile: asked again from 0
        eng.step({"second": len(prompt)})
        assert not eng.worker.take_load_errors()
        for i in range(external // BS):  # the engine treats tokens [0, external) as loaded
            assert np.array_equal(engine_buffer.array[table[i]], engine_buffer.array[i]), \
                f"block {i} of the prefix (engine block {table[i]}) is not what was stored"
    finally:
        eng.close()


# ---------------------------------------------------------------------------- window 2
@pytest.mark.stress_long  # a 33 s stall (the old fixed wait was 30 s); C1 has a unit test
def test_a_store_is_waited_for_until_its_deadline(stress_node, engine_buffer):
    """A's store sleeps 33 s on the store lane, inside its 40 s job timeout. After a preemption
    the fence must not hand A's blocks back while the copy may still read them: before the fix
    it gave up after a fixed 30 s, another request's KV went there, and the copy stored that
    under A's keys."""
    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0, job_timeout_s=40, faults=(("STALL", "store:1:33"),)))
    eng = CoreEngine(node, engine_buffer)
    try:
        a = Req("A", tokens(2, 5 * BS + 1))
        eng.schedule(a, range(6))
        t0 = time.monotonic()
        eng.step({"A": len(a.all_token_ids)})
        original = engine_buffer.array[0:5].copy()
        plan = eng.step({}, preempted=["A"])  # the fence runs before the blocks are rewritten
        assert plan.fence
        eng.reuse(range(5), 0xAB)
        time.sleep(max(0.0, 34 - (time.monotonic() - t0)))  # the copy has run and reported
        assert node.injected_faults(), "the store did not stall: the window was not opened"
        again = Req("again", a.all_token_ids[:5 * BS] + tokens(3, 10))
        n = eng.schedule(again, range(10, 16)) // BS
        eng.step({"again": len(again.all_token_ids)})
        if not eng.worker.take_load_errors():
            assert np.array_equal(engine_buffer.array[10:10 + n], original[:n]), \
                "kvbm served bytes its store read after the engine reused the blocks"
    finally:
        eng.close()


@pytest.mark.parametrize("planned", [False, True], ids=["stores_in_step", "planned_stores"])
def test_a_stored_copy_read_after_its_deadline_is_never_served(stress_node, engine_buffer, planned):
    """A's store stalls inside its first chunk for 17 s, past its 10 s deadline (the copy
    checked the time before the chunk, as a process stopped mid-copy would have). The fence
    gives the blocks back at deadline + margin (15 s); the copy then reads another request's KV
    and reports before the job expires (20 s): the leader must refuse a store reported after
    its deadline, so those bytes are never served."""
    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0, job_timeout_s=10,
                                  faults=(("STALL_COPY", "store:1:17"),)))
    eng = CoreEngine(node, engine_buffer, planned_stores=planned)
    try:
        a = Req("A", tokens(4, 4 * BS + 1))
        eng.schedule(a, range(5))
        t0 = time.monotonic()
        eng.step({"A": len(a.all_token_ids)})
        original = engine_buffer.array[0:4].copy()
        eng.step({}, preempted=["A"])
        assert time.monotonic() - t0 < 17, "the fence waited for the stalled copy"
        eng.reuse(range(4), 0xAB)
        time.sleep(max(0.0, 18 - (time.monotonic() - t0)))  # the copy read the reused blocks and reported
        assert node.injected_faults(), "the store did not stall: the window was not opened"
        again = Req("again", a.all_token_ids[:4 * BS] + tokens(5, 10))
        n = eng.schedule(again, range(10, 16)) // BS
        eng.step({"again": len(again.all_token_ids)})
        if n and not eng.worker.take_load_errors():
            assert np.array_equal(engine_buffer.array[10:10 + n], original[:n]), "a late store was served"
    finally:
        eng.close()


# ---------------------------------------------------------------------------- window 3
@pytest.mark.stress_long  # a 33 s stall (the old fixed wait was 30 s); C1 has a unit test
def test_a_load_is_waited_for_until_its_deadline(stress_node, engine_buffer):
    """A load sleeps 33 s on the load lane, inside its 40 s job timeout. Before the fix the
    connector gave up after a fixed 30 s (the engine recomputed, the request ended and its
    blocks went to another request), then the copy wrote the other request's blocks."""
    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0, job_timeout_s=40, faults=(("STALL", "load:1:33"),)))
    eng = CoreEngine(node, engine_buffer)
    try:
        a = Req("A", tokens(6, 5 * BS + 1))
        eng.store(a, range(6))
        t0 = time.monotonic()
        again = Req("again", a.all_token_ids[:5 * BS] + tokens(7, 10))
        assert eng.schedule(again, range(10, 16)) == 5 * BS
        eng.step({"again": len(again.all_token_ids)})  # the synchronous load is waited for here
        failed = eng.worker.take_load_errors()
        eng.release("again")
        eng.reuse(range(10, 15), 0xCD)
        time.sleep(max(0.0, 35 - (time.monotonic() - t0)))
        assert node.injected_faults(), "the load did not stall: the window was not opened"
        assert (engine_buffer.array[10:15] == 0xCD).all(), \
            f"a load copy wrote blocks the engine had given to another request (load failed: {bool(failed)})"
    finally:
        eng.close()


def test_a_worker_that_never_answers_a_load_is_stopped_before_the_blocks_go_back(stress_node, engine_buffer):
    """A load stalls inside its first chunk for 15 s, far past its 3 s deadline (a stopped or
    frozen process writes no later than that only if it never runs again). The connector
    must not report the load failed and let the blocks go while that copy can still land:
    it kills the unresponsive daemon and waits for it to be gone."""
    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0, job_timeout_s=3,
                                  faults=(("STALL_COPY", "load:1:15"),)))
    eng = CoreEngine(node, engine_buffer)
    try:
        a = Req("A", tokens(8, 4 * BS + 1))
        eng.store(a, range(5))
        t0 = time.monotonic()
        again = Req("again", a.all_token_ids[:4 * BS] + tokens(9, 10))
        assert eng.schedule(again, range(10, 15)) == 4 * BS
        eng.step({"again": len(again.all_token_ids)})
        waited = time.monotonic() - t0
        assert eng.worker.take_load_errors(), "the stalled load cannot have succeeded"
        assert waited < 14, f"the engine waited {waited:.1f}s for a load whose deadline was 3 s away"
        eng.release("again")
        eng.reuse(range(10, 14), 0xCD)
        time.sleep(max(0.0, 16 - (time.monotonic() - t0)))
        assert node.injected_faults(), "the load did not stall: the window was not opened"
        assert (engine_buffer.array[10:14] == 0xCD).all(), "a late load copy landed in reused blocks"
        assert node.process(Daemon.WORKER).exited, "the unresponsive worker still runs"
    finally:
        eng.close()


# ---------------------------------------------------------------------------- window 4 (its CPU part)
@pytest.mark.parametrize("planned", [False, True], ids=["stores_in_step", "planned_stores"])
def test_an_early_load_never_lands_in_blocks_a_store_still_reads(stress_node, engine_buffer, planned):
    """The engine preempts A while A's store (stalled 6 s on the store lane) still reads A's
    blocks, and gives them to R, whose prefix comes from kvbm. R's load must wait for the
    worker side's fence: started early (when the engine allocated R's blocks) it wrote them
    at once, and A's store then kept R's bytes under A's keys."""
    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0, faults=(("STALL", "store:2:6"),)))
    eng = CoreEngine(node, engine_buffer, early=True, planned_stores=planned)
    try:
        x = Req("X", tokens(13, 4 * BS + 1))
        eng.store(x, range(10, 15))  # store 1: R's prefix in kvbm
        a = Req("A", tokens(14, 4 * BS + 1))
        eng.schedule(a, range(5))
        eng.step({"A": len(a.all_token_ids)})  # store 2: reads engine blocks 0..3 for 6 s
        original = engine_buffer.array[0:4].copy()
        r = Req("R", x.all_token_ids[:4 * BS] + tokens(15, 10))
        assert eng.schedule(r, [0, 1, 2, 3, 20]) == 4 * BS  # A's blocks, taken back by the preemption
        eng.step({"R": len(r.all_token_ids)}, preempted=["A"])
        eng.worker.fence()
        assert node.injected_faults(), "A's store did not stall: the window was not opened"
        again = Req("again", a.all_token_ids[:4 * BS] + tokens(16, 10))
        n = eng.schedule(again, range(24, 29)) // BS
        eng.step({"again": len(again.all_token_ids)})
        assert n == 4 and not eng.worker.take_load_errors()
        assert np.array_equal(engine_buffer.array[24:28], original), "A's keys hold another request's KV"
    finally:
        eng.close()


# ---------------------------------------------------------------------------- window 5
def test_old_leaders_report_does_not_confirm_a_new_job(stress_node, engine_buffer):
    """Job ids restart at 1 with a new leader: the first leader's job 1 (stalled 15 s on the
    store lane) must not confirm the new leader's job 1 (queued behind it, stalled 8 s)."""
    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0, faults=(("STALL", "store:1:15,store:2:8"),)))
    client = client_of(node)
    try:
        client.register_region("0", engine_buffer.spec())
        client.wait_ready(30)
        old_keys, new_keys = keys("old", 4), keys("new", 4)
        client.offload(old_keys, [0, 1, 2, 3])  # job 1 of the first leader
        t0 = time.monotonic()
        time.sleep(0.5)
        node.kill(Daemon.LEADER)
        node.restart(Daemon.LEADER)
        node.wait_ready(60)
        client.wait_ready(60)  # the session of the dead leader is re-opened
        handle = client.offload(new_keys, [4, 5, 6, 7])  # job 1 of the new leader
        time.sleep(max(0.0, 15.5 - (time.monotonic() - t0)))  # the old job has copied
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


# ---------------------------------------------------------------------------- window 6
def test_load_that_starts_after_its_deadline_fails(stress_node, engine_buffer):
    """A load accepted in time reaches its lane after its job expired and its slots hold
    another block: it must fail, not copy (closed by the lane's deadline check)."""
    node = stress_node(NodeConfig(g2_blocks=4, g3_blocks=0, job_timeout_s=2.0, faults=(("STALL", "load:1:6"),)))
    client = client_of(node)
    try:
        client.register_region("0", engine_buffer.spec())
        client.wait_ready(30)
        first, second = keys("first", 4), keys("second", 4)
        client.wait(client.offload(first, [0, 1, 2, 3]))
        t0 = time.monotonic()
        load = client.onboard(first, [10, 11, 12, 13])  # accepted at once, sleeps 6 s on the load lane
        assert load.num_blocks == 4
        time.sleep(4.5)  # the job expired: G2 is full of evictable blocks
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


def test_a_copy_stalled_past_its_expiry_never_overwrites_a_later_block(stress_node, engine_buffer):
    """A store stalls inside its first chunk past its job's expiry (deadline + grace), when the
    leader has given its G2 slots to another block. Every write to a slot runs on the store
    lane, in order, so the later block's store runs after the stalled copy and its bytes are
    what is served (a load reading a slot after its job's deadline fails its time check)."""
    node = stress_node(NodeConfig(g2_blocks=4, g3_blocks=0, job_timeout_s=2.0,
                                  faults=(("STALL_COPY", "store:1:5.5"),)))
    client = client_of(node)
    try:
        client.register_region("0", engine_buffer.spec())
        client.wait_ready(30)
        first, second = keys("first", 4), keys("second", 4)
        stalled = client.offload(first, [0, 1, 2, 3])  # stalls 5.5 s inside its copy
        t0 = time.monotonic()
        time.sleep(4.5)  # past deadline + grace (4 s): its slots are free again
        handle = client.offload(second, [4, 5, 6, 7])
        assert handle.num_blocks == 4, "precondition: the second store got the first one's slots"
        client.wait(handle)
        assert time.monotonic() - t0 > 5.5 and node.injected_faults(), "the first store did not stall"
        with pytest.raises(Exception):
            client.wait(stalled)  # past its deadline: never confirmed
        load = client.onboard(second, [10, 11, 12, 13])
        client.wait(load)
        assert load.num_blocks == 4
        assert np.array_equal(engine_buffer.array[10:14], engine_buffer.array[4:8]), \
            "a copy of an expired job overwrote slots the leader had given to another block"
    finally:
        client.close()


# ---------------------------------------------------------------------------- window 7
@pytest.mark.parametrize("planned", [False, True], ids=["stores_in_step", "planned_stores"])
def test_blocks_computed_over_a_failed_load_are_never_stored(stress_node, engine_buffer, planned):
    """A step's forward runs after its synchronous load failed, so every block it computes
    after the unloaded ones holds KV computed from garbage; the engine recomputes them, but
    the step's stores must not keep them (found by the sigstop and disk-eio passes)."""
    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0, faults=(("FAIL", "load:1"),)))
    eng = CoreEngine(node, engine_buffer, planned_stores=planned)
    try:
        a = Req("A", tokens(10, 4 * BS + 1))
        eng.store(a, range(5))
        a2 = Req("A2", a.all_token_ids[:4 * BS] + tokens(11, 3 * BS + 5))
        assert eng.schedule(a2, range(10, 18)) == 4 * BS
        eng.step({"A2": len(a2.all_token_ids)})  # the load fails; the forward computes blocks 4..6
        assert eng.worker.take_load_errors(), "the load did not fail"
        eng.step({})  # (planned stores ship with this step, and are dropped there)
        eng.worker.fence()
        assert eng.matched(a2.all_token_ids) == 4, "blocks computed over a failed load were stored"
    finally:
        eng.close()


# ---------------------------------------------------------------------------- window 8
def test_worker_side_keeps_its_region_after_a_leader_restart(stress_node, engine_buffer):
    """A store the new leader does not know fails; the daemon is alive and still holds the
    engine's region, so the worker side must not take the failure for a lost daemon (it
    dropped its region and the daemon refused to register the same one again)."""
    node = stress_node(NodeConfig(g2_blocks=64, g3_blocks=0, faults=(("STALL", "store:1:4"),)))
    eng = CoreEngine(node, engine_buffer)
    try:
        assert eng.worker.link.region_id is not None
        a = Req("A", tokens(12, 4 * BS + 1))
        eng.schedule(a, range(5))
        eng.step({"A": len(a.all_token_ids)})  # the copy sleeps 4 s on the store lane
        node.kill(Daemon.LEADER)
        node.restart(Daemon.LEADER)
        node.wait_ready(60)
        eng.worker.fence()  # the store fails: the new leader does not know its job
        time.sleep(2)  # a few watchdog rounds (retry_s 0.5)
        assert eng.worker.link.region_id is not None, "the worker side lost its region and cannot register it again"
    finally:
        eng.close()
