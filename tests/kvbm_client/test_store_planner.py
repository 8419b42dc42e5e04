"""Store plans asked for off the scheduler's thread (``connectors/core/store_planner.py``) and
what keeps them safe a step late: the scheduler core ships them with the next step, counts
their requests as having stores (delayed frees, fences), and the vLLM worker role sends them
before the next forward, the fence waiting for them. Fake leader and fake region link; the
real engine runs them in tests/vllm and tests/stress."""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from kvbm_client.connectors.core import (ConnectorSettings, LoadSpec, RequestExtras, RequestId, SchedulerCore,
                                         StoreSpec, WorkerCore)
from kvbm_client.connectors.core.specs import StepPlan
from kvbm_client.connectors.core.store_planner import StorePlanner
from kvbm_client.connectors.vllm.worker import KvbmConnectorWorker
from kvbm_client.contract import pb
from kvbm_client.handles import TransferHandle
from kvbm_client.ids import JobId, PlanKind, WorkerId
from kvbm_client.connectors.core.block_holds import BlockHolds
from support.fake_pool import FakePool

BS = 4


class GatedLeader:
    """Plans a store of every key not stored yet; ``prepare_store`` answers only once ``gate``
    is set, and records the thread it ran on. ``down``: answers None; ``broken``: raises."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.stored: set[bytes] = set()
        self.threads: list[str] = []
        self.released: list[TransferHandle] = []
        self.down = self.broken = False
        self._jobs = itertools.count(1)

    def prepare_load(self, hashes, count_hit=False, tokens_per_block=0, prefill_tokens_per_s=0.0, stage=None):
        return TransferHandle(PlanKind.LOAD, None, 0)

    def prepare_store(self, hashes):
        self.threads.append(threading.current_thread().name)
        self.gate.wait(10)
        if self.broken:
            raise RuntimeError("a bug in the link")
        if self.down:
            return None
        new = [i for i, h in enumerate(hashes) if h not in self.stored]
        self.stored.update(hashes[i] for i in new)
        if not new:
            return TransferHandle(PlanKind.STORE, None, 0)
        job = next(self._jobs)
        signed = pb.SignedPlan(plan=f"store-{job}".encode(), signature=b"sig")
        return TransferHandle(PlanKind.STORE, JobId(job), len(new), tuple(new), signed=signed)

    def may_hold(self, key):
        return True  # (no presence filter: every lookup asks)

    def unasked(self, blocks):
        pass

    def release(self, handle):
        self.released.append(handle)

    def close(self):
        pass


@dataclass
class Request:
    request_id: str
    all_token_ids: list[int]
    extras: RequestExtras | None = field(default_factory=RequestExtras)


def make(leader: GatedLeader, wait_s: float = 5.0, min_keys: int = 1) -> SchedulerCore:
    settings = ConnectorSettings("unix:/l", "unix:/w-{id}", "model|float16|4", 1.0, 1.0)
    return SchedulerCore(BS, settings, leader, lambda r: r.extras,
                         store_planner=StorePlanner(leader, wait_s, min_keys=min_keys))


def start(core: SchedulerCore, req: Request, blocks: list[int]) -> None:
    assert core.lookup(req, 0) == (0, False)
    core.assign_blocks(req.request_id, blocks, replace=True)


def test_a_steps_stores_are_asked_off_the_thread_and_ship_with_the_next_step():
    leader = GatedLeader()
    leader.gate.clear()  # the leader has not answered yet when the step is built
    core = make(leader)
    a = Request("a", list(range(13)))
    start(core, a, [7, 8, 9, 10])
    t0 = time.perf_counter()
    first = core.step({"a": 13})
    assert time.perf_counter() - t0 < 1.0, "the step did not wait for the leader"
    assert first.stores == [] and first.earlier_stores == []
    leader.gate.set()
    second = core.step({"a": 13})  # decoding: no new full block
    (spec,) = second.earlier_stores  # the worker side sends them before this step's forward
    assert second.stores == []
    assert spec.engine_blocks == [7, 8, 9] and spec.req_ids == ["a", "a", "a"] and spec.plan == b"store-1"
    assert leader.threads == ["kvbm-store-plan_0"], "PrepareStore never runs on the scheduler's thread"
    assert core.step({"a": 13}).earlier_stores == [], "shipped once"
    core.shutdown()


def test_only_steps_with_many_new_blocks_are_planned_off_the_thread():
    """A step with fewer than ``min_keys`` new blocks is planned on the scheduler's thread and
    stored after its own forward; a bigger one ships with the next step, beside that step's own."""
    leader = GatedLeader()
    core = make(leader, min_keys=3)
    a, b = Request("a", list(range(13))), Request("b", list(range(100, 109)))
    start(core, a, [1, 2, 3, 4])
    plan = core.step({"a": 13})  # 3 new blocks: asked for off the thread
    assert plan.stores == [] and plan.earlier_stores == []
    start(core, b, [5, 6, 7])
    plan = core.step({"b": 9})  # 2 new blocks: planned here, stored after this forward
    assert [s.engine_blocks for s in plan.earlier_stores] == [[1, 2, 3]]
    assert [s.engine_blocks for s in plan.stores] == [[5, 6]]
    assert leader.threads == ["kvbm-store-plan_0", "MainThread"]
    core.shutdown()


def test_with_without_loads_a_step_that_loads_nothing_is_planned_off_the_thread_whatever_its_size():
    """``async_decode_store_plans``: a step without a load (a decode step's one new block too) is
    planned on the planner's thread; a step that loads is still planned on the scheduler's thread
    below ``min_keys`` (its round trip hides behind the load's copy)."""
    leader = FilteredLeader()
    settings = ConnectorSettings("unix:/l", "unix:/w-{id}", "model|float16|4", 1.0, 1.0)
    core = SchedulerCore(BS, settings, leader, lambda r: r.extras,
                         store_planner=StorePlanner(leader, 5.0, min_keys=64, without_loads=True))
    a = Request("a", list(range(13)))
    start(core, a, [1, 2, 3, 4])
    assert core.step({"a": 13}).stores == []  # 3 new blocks, no load: asked for off the thread
    assert [s.engine_blocks for s in core.step({"a": 13}).earlier_stores] == [[1, 2, 3]]
    b = Request("b", list(range(13)) + [50, 51, 52, 53])
    assert core.lookup(b, 0) == (3 * BS, False)  # a's three blocks
    core.allocated("b", [5, 6, 7, 8, 9], 3 * BS)
    core.assign_blocks("b", [5, 6, 7, 8, 9], replace=True)
    plan = core.step({"b": 17})  # the load into 5-7, and block 8 computed: planned here
    assert [x.engine_blocks for x in plan.loads] == [[5, 6, 7]]
    assert [s.engine_blocks for s in plan.stores] == [[8]] and plan.earlier_stores == []
    b.all_token_ids += [60, 61, 62, 63]
    plan = core.step({"b": 21})  # decoding completes block 9: off the thread again
    assert plan.stores == [] and plan.loads == []
    assert [s.engine_blocks for s in core.step({"b": 21}).earlier_stores] == [[9]]
    assert leader.threads == ["kvbm-store-plan_0", "MainThread", "kvbm-store-plan_0"]
    core.shutdown()


def test_a_request_that_ends_before_its_stores_ship_keeps_its_blocks_until_they_are_done():
    leader = GatedLeader()
    leader.gate.clear()
    core = make(leader)
    a = Request("a", list(range(9)))
    start(core, a, [1, 2, 3])
    assert core.step({"a": 9}).earlier_stores == []
    assert core.finished("a"), "a store of its blocks is planned: vLLM must not free them yet"
    leader.gate.set()
    plan = core.step({})
    assert [s.req_ids for s in plan.earlier_stores] == [["a", "a"]] and plan.delayed_frees == ["a"]
    core.shutdown()


def test_a_preempted_request_with_planned_stores_fences_the_step_that_ships_them():
    leader = GatedLeader()
    core = make(leader)
    a, b = Request("a", list(range(9))), Request("b", list(range(100, 109)))
    start(core, a, [1, 2, 3])
    start(core, b, [4, 5, 6])
    core.step({"a": 9, "b": 9})
    plan = core.step({"b": 9}, preempted=["a"])
    assert plan.fence and plan.earlier_stores
    core.shutdown()


def test_a_leader_that_is_down_or_a_failing_link_skips_the_stores_and_serving_goes_on():
    leader = GatedLeader()
    core = make(leader)
    for i, (down, broken) in enumerate([(True, False), (False, True)]):
        leader.down, leader.broken = down, broken
        r = Request(f"r{i}", list(range(10 * i, 10 * i + 9)))
        start(core, r, [1, 2, 3])
        core.step({r.request_id: 9})
        assert core.step({}).earlier_stores == []
    leader.down = leader.broken = False
    r = Request("ok", list(range(500, 509)))
    start(core, r, [1, 2, 3])
    core.step({"ok": 9})
    assert [s.engine_blocks for s in core.step({}).earlier_stores] == [[1, 2]]
    core.shutdown()


def test_an_answer_later_than_the_wait_is_skipped_and_a_plan_never_shipped_is_released():
    leader = GatedLeader()
    leader.gate.clear()
    core = make(leader, wait_s=0.2)
    a = Request("a", list(range(9)))
    start(core, a, [1, 2, 3])
    core.step({"a": 9})
    t0 = time.perf_counter()
    assert core.step({}).earlier_stores == [], "not answered within the wait: skipped"
    assert time.perf_counter() - t0 < 2.0
    leader.gate.set()
    b = Request("b", list(range(100, 109)))
    start(core, b, [4, 5, 6])
    core.step({"b": 9})  # asked; the engine stops before the next step
    core.shutdown()
    assert [h.job_id for h in leader.released] == [2], "the unshipped plan goes back to the leader"


# ---------------------------------------------------------------------------- the worker side
class SlowLink:
    """Answers each call ``delay`` seconds later, on a timer thread; records the order."""

    def __init__(self, delay: float, failing: frozenset[bytes] = frozenset()) -> None:
        self.delay = delay
        self.failing = failing
        self.sent: list[bytes] = []
        self.done: list[bytes] = []

    def submit(self, plan, signature, blocks, timeout=None, layer_groups=0, gpu=None):
        self.sent.append(plan)
        future: Future = Future()

        def answer() -> None:
            self.done.append(plan)
            if plan in self.failing:
                future.set_exception(Refused())
            else:
                future.set_result(pb.TransferResponse())
        threading.Timer(self.delay, answer).start()
        return future

    def failed(self, exc):
        pass

    def close(self):
        pass


def worker_role(link: SlowLink) -> KvbmConnectorWorker:
    settings = ConnectorSettings("unix:/nowhere/l.sock", "unix:/nowhere/w-{id}.sock", "m", 1.0, 1.0)
    role = KvbmConnectorWorker("0", settings)
    role.core = WorkerCore(WorkerId("0"), settings, link=link)  # type: ignore[arg-type]
    return role


def test_the_worker_side_sends_earlier_steps_stores_at_bind_and_a_fence_waits_for_them():
    link = SlowLink(0.2)
    role = worker_role(link)
    plan = StepPlan(earlier_stores=[StoreSpec(b"s1", b"sig", [3], ["a"])], fence=True)
    role.bind(plan)
    assert link.sent == [b"s1"] and link.done == [b"s1"], "sent before the forward, and the fence waited for it"
    role.bind(plan)  # bound again (another hook): not sent twice
    role.start_stores(plan)  # type: ignore[arg-type]  (wait_for_save: nothing more to send)
    assert link.sent == [b"s1"]
    own = StepPlan(stores=[StoreSpec(b"s2", b"sig", [4], ["a"])])  # this step's blocks: after the forward
    role.bind(own)
    assert link.sent == [b"s1"]
    role.start_stores(own)  # type: ignore[arg-type]
    assert link.sent == [b"s1", b"s2"]
    role.shutdown()


class Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.ABORTED

    def details(self):
        return "copy failed"


def test_stores_of_a_step_whose_load_failed_are_dropped_when_they_ship_a_step_late():
    """C4 with planned stores: step N's blocks were computed over a failed synchronous load;
    their stores arrive with step N+1 and are dropped there (those of N+1's blocks are not)."""
    link = SlowLink(0.0, failing=frozenset({b"bad"}))
    role = worker_role(link)
    role.core.start_loads([LoadSpec(RequestId("r"), b"bad", b"sig", [1, 2], sync=True)])  # step N: it fails
    assert role.take_load_errors() == {1, 2}
    role.bind(StepPlan(earlier_stores=[StoreSpec(b"n", b"sig", [3], ["a"])]))  # N+1
    role.core.start_loads([])
    role.bind(StepPlan(earlier_stores=[StoreSpec(b"n1", b"sig", [4], ["a"])]))  # N+2
    assert [p for p in link.sent if p != b"bad"] == [b"n1"]
    role.shutdown()


class FilteredLeader(GatedLeader):
    """A leader whose presence filter holds exactly what it stored; counts the lookups it
    answered and those the client answered itself."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[int] = []
        self.unasked_blocks = 0

    def prepare_load(self, hashes, count_hit=False, tokens_per_block=0, prefill_tokens_per_s=0.0, stage=None):
        self.loads.append(len(hashes))
        n = next((i for i, h in enumerate(hashes) if h not in self.stored), len(hashes))
        if not n:
            return TransferHandle(PlanKind.LOAD, None, 0)
        signed = pb.SignedPlan(plan=b"load", signature=b"sig")
        return TransferHandle(PlanKind.LOAD, JobId(next(self._jobs)), n, tuple(range(n)), signed=signed)

    def may_hold(self, key):
        return key in self.stored

    def unasked(self, blocks):
        self.unasked_blocks += blocks


def test_a_cold_requests_blocks_are_hashed_on_the_planners_thread_not_at_its_lookup(monkeypatch):
    from kvbm_client.hashing import BlockIdentity
    hashed_on: list[tuple[str, int]] = []
    update = BlockIdentity.update

    def recording(self, tokens):
        before = len(self.keys)
        out = update(self, tokens)
        if len(out) > before:
            hashed_on.append((threading.current_thread().name, len(out) - before))
        return out

    monkeypatch.setattr(BlockIdentity, "update", recording)
    leader = FilteredLeader()
    core = make(leader)
    a = Request("a", list(range(41)))  # 10 full blocks
    start(core, a, list(range(11)))
    assert leader.loads == [] and leader.unasked_blocks == 10, "ruled out by the filter: no PrepareLoad"
    assert hashed_on == [("MainThread", 1)], "the lookup hashed the first block only"
    core.step({"a": 41})
    spec = core.step({"a": 41}).earlier_stores[0]
    assert hashed_on[1:] == [("kvbm-store-plan_0", 9)], "the step's other 9 blocks were hashed on the planner's thread"
    assert spec.engine_blocks == list(range(10))
    fresh = BlockIdentity("model|float16|4", BS).update(a.all_token_ids)
    assert leader.stored == set(fresh), "the keys a fresh identity gives"
    core.shutdown()


def test_a_next_turn_the_filter_admits_still_starts_from_the_last_turns_keys():
    leader = FilteredLeader()
    core = make(leader)
    a = Request("a", list(range(41)))
    start(core, a, list(range(11)))
    core.step({"a": 41})
    core.step({"a": 41})
    core.finished("a")
    b = Request("b", list(range(41)) + [7] * 8)  # the next turn: the whole last prompt, then more
    assert core.lookup(b, 0) == (10 * BS, False), "stored: asked and matched"
    assert leader.loads == [12], "its 12 blocks before the last token"
    assert core._reqs[RequestId("b")].identity.reused == 10, "the probe did not keep it from adopting turn 1's keys"
    core.shutdown()


def test_a_big_steps_request_that_turns_out_unkeyable_stores_nothing():
    leader = GatedLeader()
    core = make(leader)
    a = Request("a", list(range(8)) + [1 << 40] + list(range(3)))  # a token id beyond 32 bits in block 2
    start(core, a, [1, 2, 3])
    core.step({"a": 12})
    plan = core.step({"a": 12})
    assert plan.earlier_stores == [] and leader.stored == set()
    core.shutdown()



def test_a_store_planned_off_the_thread_pins_its_blocks_from_the_ask_so_a_request_ending_first_frees_none_of_them():
    leader, pool = GatedLeader(), FakePool()
    leader.gate.clear()
    core = make(leader)
    core.holds = BlockHolds(pool, reporters=2)
    a = Request("a", list(range(13)))
    core.lookup(a, 0)
    core.assign_blocks("a", [7, 8, 9, 10], replace=True)
    assert core.step({"a": 13}).earlier_stores == []
    assert pool.pinned == {7, 8, 9}, "pinned before the leader answered"
    assert core.finished("a") is False
    leader.gate.set()
    (store,) = core.step({}).earlier_stores
    assert store.store_id > 0 and pool.pinned == {7, 8, 9}
    core.stores_settled([store.store_id])
    assert pool.pinned == {7, 8, 9}, "one of the two worker sides reported"
    core.stores_settled([store.store_id])
    assert pool.pinned == set()
    core.shutdown()
