"""The connectors' engine-independent scheduler core (``connectors/core/scheduler.py``): its
decisions against a fake leader that remembers what was stored. No engine, no daemon."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import pytest

from kvbm_client.handles import TransferHandle
from kvbm_client.connectors.core import ConnectorSettings, RequestExtras, SchedulerCore
from kvbm_client.contract import pb
from kvbm_client.ids import JobId, PlanKind
from kvbm_client.leader_session import StageAsk
from kvbm_client.connectors.core.block_holds import BlockHolds
from support.fake_pool import FakePool

BS = 4


class FakeLeader:
    """Keeps the set of stored keys; plans loads of the longest stored prefix and stores of the
    keys not stored yet (it commits them at once). ``down``: unreachable (answers None)."""

    def __init__(self) -> None:
        self.stored: set[bytes] = set()
        self.calls: list[tuple[str, list]] = []
        self.released: list[TransferHandle] = []
        self.down = False
        self.deadline = 0.0  # of the plans it signs (0: none)
        self._jobs = itertools.count(1)
        self.presence: set[bytes] | None = None  # a presence filter's "maybe" keys (None: no filter)
        self.unasked_blocks = 0
        self.stages: list = []  # each prepare_load's stage ask (None: none)

    def _handle(self, kind: PlanKind, indices: list[int]) -> TransferHandle:
        if not indices:
            return TransferHandle(kind, None, 0)
        job = next(self._jobs)
        signed = pb.SignedPlan(plan=f"plan-{job}".encode(), signature=b"sig")
        return TransferHandle(kind, JobId(job), len(indices), tuple(indices), deadline=self.deadline, signed=signed)

    def prepare_load(self, hashes, count_hit=False, tokens_per_block=0, prefill_tokens_per_s=0.0, stage=None):
        self.calls.append(("prepare_load", list(hashes)))
        self.stages.append(stage)
        if self.down:
            return None
        n = next((i for i, h in enumerate(hashes) if h not in self.stored), len(hashes))
        return self._handle(PlanKind.LOAD, list(range(n)))

    def prepare_store(self, hashes):
        self.calls.append(("prepare_store", list(hashes)))
        if self.down:
            return None
        new = [i for i, h in enumerate(hashes) if h not in self.stored]
        self.stored.update(hashes[i] for i in new)
        return self._handle(PlanKind.STORE, new)

    def may_hold(self, key):
        return self.presence is None or key in self.presence

    def unasked(self, blocks):
        self.unasked_blocks += blocks

    def release(self, handle):
        self.released.append(handle)

    def close(self):
        pass

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@dataclass
class Request:
    """A stand-in for an engine's request (the core's ``EngineRequest``)."""

    request_id: str
    all_token_ids: list[int]
    extras: RequestExtras | None = field(default_factory=RequestExtras)


class FakeEarly:
    def __init__(self) -> None:
        self.sent = []
        self.targets = (("0", "region-a"), ("1", "region-b"))  # the workers whose region is known

    def submit(self, spec):
        self.sent.append(spec)
        return 1

    def stage_targets(self):
        return self.targets

    def close(self):
        pass


def make(leader: FakeLeader, mode: str = "sync", early=None, overlapping_steps: int = 1,
         store_blocks: bool = True, min_computed_tokens: int = 1, staged_loads: bool = False) -> SchedulerCore:
    settings = ConnectorSettings("unix:/l", "unix:/w-{id}", "model|float16|4", 1.0, 1.0, load_mode=mode,
                                 store_blocks=store_blocks, min_computed_tokens=min_computed_tokens,
                                 staged_loads=staged_loads)
    return SchedulerCore(BS, settings, leader, lambda r: r.extras, early, overlapping_steps=overlapping_steps)


def run_prefill(core: SchedulerCore, req: Request, block_ids: list[int], local: int = 0):
    """Lookup, allocation and one step computing the whole prompt, as an engine would."""
    tokens, _ = core.lookup(req, local)
    core.allocated(req.request_id, block_ids, tokens)
    core.assign_blocks(req.request_id, block_ids, replace=True)
    plan = core.step({req.request_id: len(req.all_token_ids)})
    return tokens, plan


def test_every_completed_block_is_stored_once_in_one_call_per_step():
    leader = FakeLeader()
    core = make(leader)
    a, b = Request("a", list(range(10))), Request("b", list(range(100, 113)))
    for r in (a, b):
        assert core.lookup(r, 0) == (0, False)
    core.assign_blocks("a", [7, 8, 9], replace=True)
    core.assign_blocks("b", [1, 2, 3, 4], replace=True)
    plan = core.step({"a": 10, "b": 13})
    (store,) = plan.stores
    assert leader.names() == ["prepare_load", "prepare_load", "prepare_store"]
    assert store.engine_blocks == [7, 8, 1, 2, 3] and store.req_ids == ["a", "a", "b", "b", "b"]
    a.all_token_ids += [1, 2]  # a grows by two tokens: its third block completes in the next step
    plan = core.step({"a": 12, "b": 13})
    assert plan.stores[0].engine_blocks == [9] and plan.stores[0].req_ids == ["a"]
    assert len(leader.calls[-1][1]) == 1, "blocks already stored are not offered again"


def test_an_engine_that_does_not_store_blocks_still_loads_hits_and_never_asks_to_store():
    leader = FakeLeader()
    run_prefill(make(leader), Request("x", list(range(21))), [0, 1, 2, 3, 4, 5])  # a storing engine
    reader = make(leader, store_blocks=False)
    tokens, plan = run_prefill(reader, Request("y", list(range(21)) + list(range(900, 912))), list(range(10, 19)))
    assert tokens == 5 * BS and [x.engine_blocks for x in plan.loads] == [[10, 11, 12, 13, 14]]
    assert plan.stores == [] and plan.earlier_stores == [] and not plan.fence
    assert leader.names() == ["prepare_load", "prepare_store", "prepare_load"], "no PrepareStore of its own"
    assert reader.finished("y") is False, "no store of it in flight: its blocks are freed at once"


def test_a_hit_is_loaded_into_the_blocks_after_the_local_prefix_and_not_stored_again():
    leader, early = FakeLeader(), FakeEarly()
    first = make(leader)
    run_prefill(first, Request("x", list(range(21))), [0, 1, 2, 3, 4, 5])
    core = make(leader, early=early)  # another engine process: same identity
    req = Request("y", list(range(21)))
    assert core.lookup(req, 1 * BS) == (4 * BS, False), "1 local block, 4 from kvbm, the last token computed"
    assert core.pending_load("y")
    core.allocated("y", [10, 11, 12, 13, 14, 15], 4 * BS)
    core.assign_blocks("y", [10, 11, 12, 13, 14, 15], replace=True)
    plan = core.step({"y": 21})
    (load,) = early.sent
    assert load.engine_blocks == [11, 12, 13, 14] and load.sync and load.req_id == "y"
    assert plan.loads == [load]
    assert plan.stores == [], "the loaded blocks are in kvbm already"
    assert core.lookup(req, 5 * BS) == (0, False), "a request loads once"


@pytest.mark.parametrize("mode,staged_loads,stages", [("layerwise", True, 1), ("layerwise", False, 0),
                                                      ("sync", True, 0)])
def test_a_new_hit_is_staged_by_its_lookup_once(mode, staged_loads, stages):
    """With staged_loads (and layer groups: layerwise), the lookup asks the leader to stage the
    hit on the workers whose region is known, before the engine allocated blocks; asked again
    while it waits, it is neither looked up nor staged again."""
    leader, early = FakeLeader(), FakeEarly()
    run_prefill(make(leader), Request("x", list(range(21))), [0, 1, 2, 3, 4, 5])
    leader.stages.clear()
    core = make(leader, mode=mode, early=early, staged_loads=staged_loads)
    req = Request("y", list(range(21)))
    assert core.lookup(req, 0) == (5 * BS, False)
    assert core.lookup(req, 0) == (5 * BS, False)  # the engine asks again (e.g. no room this step)
    asks = [s for s in leader.stages if s is not None]
    assert len(leader.stages) == 1 and len(asks) == stages and early.sent == []
    if stages:
        assert asks[0] == StageAsk(6, (("0", "region-a"), ("1", "region-b")))  # the engine's layer groups
    core.allocated("y", [10, 11, 12, 13, 14, 15], 5 * BS)
    core.step({"y": 21})
    assert len(early.sent) == 1 and len(leader.stages) == 1, "the early load follows; no second lookup"


def test_no_stage_is_asked_before_a_worker_region_is_known():
    leader, early = FakeLeader(), FakeEarly()
    run_prefill(make(leader), Request("x", list(range(21))), [0, 1, 2, 3, 4, 5])
    leader.stages.clear()
    early.targets = ()
    core = make(leader, mode="layerwise", early=early, staged_loads=True)
    assert core.lookup(Request("y", list(range(21))), 0) == (5 * BS, False)
    assert leader.stages == [None]


@pytest.mark.parametrize("length,least,loaded", [(21, 1, 5), (21, 2, 4), (22, 2, 5), (23, 5, 4), (20, 1, 4),
                                                 (20, 2, 4), (6, 5, 0)])
def test_a_hit_leaves_the_engine_at_least_min_computed_tokens_to_compute(length, least, loaded):
    # (layer-pipelined loads under FULL decode graphs: a step computing only a decode query's
    # worth of tokens could run as a FULL graph, which skips the layer hooks)
    leader = FakeLeader()
    run_prefill(make(leader), Request("x", list(range(40))), list(range(10)))
    core = make(leader, mode="layerwise", min_computed_tokens=least)
    tokens, _ = core.lookup(Request("y", list(range(length))), 0)
    assert tokens == loaded * BS and length - tokens >= least


def test_an_asynchronous_hit_is_answered_the_same_while_the_request_waits():
    leader = FakeLeader()
    run_prefill(make(leader), Request("x", list(range(17))), [0, 1, 2, 3, 4])
    core = make(leader, mode="async")
    req = Request("y", list(range(17)))
    assert core.lookup(req, 0) == (4 * BS, True)
    assert core.lookup(req, 0) == (4 * BS, True)
    assert leader.names().count("prepare_load") == 2, "asked again: no second round trip"


def test_a_held_hit_is_planned_again_when_the_local_prefix_changed_while_the_request_waited():
    """Issue 17 window 1: the engine counts the loaded tokens after the local prefix of the
    lookup it acted on; a plan made for another local prefix would land elsewhere."""
    leader, early = FakeLeader(), FakeEarly()
    run_prefill(make(leader), Request("x", list(range(21))), [0, 1, 2, 3, 4, 5])
    core = make(leader, early=early)
    req = Request("y", list(range(21)))
    assert core.lookup(req, 2 * BS) == (3 * BS, False), "2 local blocks, 3 from kvbm"
    assert core.lookup(req, 2 * BS) == (3 * BS, False), "asked again, same local prefix: same plan"
    assert core.lookup(req, 0) == (5 * BS, False), "the engine's cache lost its 2 blocks meanwhile"
    assert [h.num_blocks for h in leader.released] == [3], "the first plan is given back"
    core.allocated("y", [10, 11, 12, 13, 14, 15], 5 * BS)
    assert core.step({}).loads[0].engine_blocks == [10, 11, 12, 13, 14]


def test_a_held_hit_past_its_deadline_is_planned_again():
    leader = FakeLeader()
    run_prefill(make(leader), Request("x", list(range(17))), [0, 1, 2, 3, 4])
    core = make(leader)
    req = Request("y", list(range(17)))
    leader.deadline = time.monotonic() - 1  # the request waits for space past the plan's deadline
    assert core.lookup(req, 0) == (4 * BS, False)
    leader.deadline = 0.0
    assert core.lookup(req, 0) == (4 * BS, False)
    assert len(leader.released) == 1 and leader.names().count("prepare_load") == 3


def test_the_engine_may_take_what_the_lookup_answered_without_saying_how_much():
    leader, early = FakeLeader(), FakeEarly()
    run_prefill(make(leader), Request("x", list(range(17))), [0, 1, 2, 3, 4])
    core = make(leader, early=early)
    assert core.lookup(Request("y", list(range(17))), 0) == (4 * BS, False)
    core.allocated("y", [9, 8, 7, 6, 5])  # TensorRT-LLM's update_state_after_alloc has no count
    core.step({})
    assert early.sent[0].engine_blocks == [9, 8, 7, 6]


def test_no_load_starts_early_in_a_step_that_fences():
    """Issue 17 window 4: the engine took a preempted request's blocks back in this step; a
    load of this step may land in them while a store still reads them. Only the worker
    side's fence orders the two, so the load waits for the worker side."""
    leader, early = FakeLeader(), FakeEarly()
    core = make(leader, early=early)
    preempted = Request("p", list(range(100, 109)))
    run_prefill(core, preempted, [0, 1, 2])  # its two blocks are being stored
    run_prefill(make(leader), Request("x", list(range(17))), [0, 1, 2, 3, 4])
    core.lookup(Request("y", list(range(17))), 0)
    core.allocated("y", [0, 1, 5, 6, 7], 4 * BS)  # blocks 0 and 1 were the preempted request's
    plan = core.step({}, preempted=["p"])
    assert plan.fence and [x.engine_blocks for x in plan.loads] == [[0, 1, 5, 6]]
    assert early.sent == [], "started before the fence"


@pytest.mark.parametrize("overlapping,held_steps", [(1, 0), (2, 1), (3, 2)])
def test_no_load_starts_early_while_a_step_in_flight_fenced(overlapping, held_steps):
    """With overlapping steps the engine schedules the next steps while the worker side of the
    fencing one may still wait at its fence; a preempted request's blocks may already be given
    to a load of those steps (vLLM frees them once the steps that wrote them ran, not once kvbm's
    stores that read them are done). Their loads wait for the worker side too, then early loads
    resume."""
    leader, early = FakeLeader(), FakeEarly()
    core = make(leader, early=early, overlapping_steps=overlapping)
    preempted = Request("p", list(range(100, 109)))
    run_prefill(core, preempted, [0, 1, 2])  # its two blocks are being stored
    run_prefill(make(leader), Request("x", list(range(17))), [0, 1, 2, 3, 4])
    assert core.step({}, preempted=["p"]).fence
    for i in range(held_steps + 1):
        early.sent.clear()
        core.lookup(Request(f"y{i}", list(range(17))), 0)
        core.allocated(f"y{i}", [0, 1, 5, 6, 7], 4 * BS)  # blocks 0 and 1 were the preempted request's
        plan = core.step({})
        assert not plan.fence and len(plan.loads) == 1, "the worker side still gets the load"
        if i < held_steps:
            assert early.sent == [], f"step {i + 1} after the fence started early with {overlapping} steps in flight"
        else:
            assert early.sent == plan.loads, "early loads resume once the fencing step left the window"


def test_a_pinned_hit_the_engine_does_not_take_is_released():
    leader = FakeLeader()
    run_prefill(make(leader), Request("x", list(range(17))), [0, 1, 2, 3, 4])
    core = make(leader)
    req = Request("y", list(range(17)))
    tokens, _ = core.lookup(req, 0)
    assert tokens == 4 * BS
    core.allocated("y", [], 0)  # e.g. the engine found the prefix in its own cache meanwhile
    assert [h.num_blocks for h in leader.released] == [4]
    assert not core.pending_load("y")
    assert core.step({"y": 0}).loads == []


def test_a_request_that_ends_with_stores_keeps_its_blocks_until_they_are_done():
    leader = FakeLeader()
    core = make(leader)
    stored, plain = Request("s", list(range(8))), Request("p", list(range(3)))
    run_prefill(core, stored, [0, 1])
    run_prefill(core, plain, [2])
    assert core.finished("s") is True
    assert core.finished("p") is False, "nothing stored: free at once"
    assert core.finished("unknown") is False
    plan = core.step({})
    assert plan.delayed_frees == ["s"]
    assert core.step({}).delayed_frees == [], "reported once"


@pytest.mark.parametrize("stores,fence", [(True, True), (False, False)])
def test_a_preempted_request_with_stores_fences_the_step(stores, fence):
    core = make(FakeLeader())
    req = Request("r", list(range(8 if stores else 3)))
    run_prefill(core, req, [0, 1])
    assert core.step({}, preempted=["r", "other"]).fence is fence


def test_a_resumed_request_stores_into_its_new_blocks():
    core = make(FakeLeader())
    req = Request("r", list(range(6)))
    run_prefill(core, req, [0, 1])  # block 0 stored from engine block 0
    core.assign_blocks("r", [5, 6, 7], replace=True)  # preempted and resumed elsewhere
    req.all_token_ids += [9, 9, 9]
    plan = core.step({"r": 9})
    assert plan.stores[0].engine_blocks == [6]


def test_a_leader_that_is_down_costs_hits_and_stores_never_a_failure():
    leader = FakeLeader()
    leader.down = True
    core = make(leader)
    req = Request("r", list(range(9)))
    tokens, plan = run_prefill(core, req, [0, 1, 2])
    assert tokens == 0 and plan.stores == []
    assert core.finished("r") is False


def test_tenants_never_share_keys_and_a_restart_shares_them():
    leader = FakeLeader()
    run_prefill(make(leader), Request("a", list(range(13)), extras=RequestExtras(cache_salt="tenant-a")),
                [0, 1, 2, 3])
    other = make(leader)
    b = Request("b", list(range(13)), extras=RequestExtras(cache_salt="tenant-b"))
    assert other.lookup(b, 0) == (0, False), "tenant B was offered tenant A's blocks"
    again = Request("c", list(range(13)), extras=RequestExtras(cache_salt="tenant-a"))
    assert other.lookup(again, 0) == (3 * BS, False), "tenant A missed its own blocks after a restart"


def test_requests_without_an_identity_are_left_alone():
    leader = FakeLeader()
    core = make(leader)
    req = Request("e", list(range(12)), extras=None)  # e.g. prompt embeddings
    tokens, plan = run_prefill(core, req, [0, 1, 2])
    assert tokens == 0 and plan.stores == [] and leader.calls == []


def test_the_trace_marks_when_the_engine_allocated_a_hits_blocks(tmp_path, monkeypatch):
    """ttft_breakdown.py splits "answer -> copy sent" at this event (vLLM's allocation vs the
    rest of its scheduling)."""
    import json

    from kvbm_client.connectors.core import tracing
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(tracing, "TRACE_PATH", str(path))
    leader, early = FakeLeader(), FakeEarly()
    run_prefill(make(leader), Request("x", list(range(21))), [0, 1, 2, 3, 4, 5])
    core = make(leader, early=early)
    core.lookup(Request("y", list(range(21))), 0)
    core.allocated("y", [10, 11, 12, 13, 14, 15], 5 * BS)
    core.step({})
    events = [json.loads(line) for line in path.read_text().splitlines()]
    whats = [e["what"] for e in events]
    assert whats.index("prepare_load") < whats.index("allocated") < whats.index("early_load")
    assert next(e for e in events if e["what"] == "allocated")["blocks"] == 5


def test_a_second_turn_asks_the_leader_with_the_keys_a_fresh_identity_gives(tmp_path, monkeypatch):
    """The next turn of a conversation (the last turn's prompt and output, then new text) starts
    from the last turn's identity (the core's IdentityCache): the lookup's keys are exactly a
    fresh BlockIdentity's, and the trace says how many blocks were reused, not hashed."""
    import json
    import random

    from kvbm_client.connectors.core import tracing
    from kvbm_client.hashing import BlockIdentity
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(tracing, "TRACE_PATH", str(path))
    rnd = random.Random(5)
    leader = FakeLeader()
    core = make(leader)
    turn1 = Request("t1", [rnd.randrange(128_256) for _ in range(10 * BS + 1)])
    run_prefill(core, turn1, list(range(11)))
    turn1.all_token_ids += [rnd.randrange(128_256) for _ in range(2 * BS + 2)]  # its output
    core.assign_blocks("t1", [11, 12, 13], replace=False)
    core.step({"t1": len(turn1.all_token_ids)})
    assert core.finished("t1") is True
    turn2 = Request("t2", turn1.all_token_ids + [rnd.randrange(128_256) for _ in range(3 * BS + 1)])
    tokens, _ = core.lookup(turn2, 0)
    fresh = BlockIdentity(core.settings.namespace, BS, RequestExtras()).update(turn2.all_token_ids)
    last = (len(turn2.all_token_ids) - 1) // BS
    assert leader.calls[-1] == ("prepare_load", fresh[:last])
    assert tokens == 12 * BS, "the first turn's stored blocks (prompt and output) are hits"
    lookups = [e for e in map(json.loads, path.read_text().splitlines()) if e["what"] == "prepare_load"]
    assert [e["reused"] for e in lookups] == [0, 12]
    assert "hash_ms" in lookups[-1]
    edited = list(turn2.all_token_ids)  # the same conversation with a token edited inside turn 1
    edited[5 * BS + 1] += 1
    core.lookup(Request("t2-edited", edited), 0)
    fresh = BlockIdentity(core.settings.namespace, BS, RequestExtras()).update(edited)
    assert leader.calls[-1] == ("prepare_load", fresh[:last])
    other = make(FakeLeader())  # another scheduler role: its own cache, nothing to reuse
    other.lookup(Request("t3", list(turn2.all_token_ids)), 0)
    assert json.loads(path.read_text().splitlines()[-1])["reused"] == 0


def test_a_lookup_whose_first_block_the_presence_filter_rules_out_is_a_miss_without_a_round_trip():
    leader = FakeLeader()
    run_prefill(make(leader), Request("x", list(range(21))), [0, 1, 2, 3, 4, 5])
    stored = set(leader.stored)
    leader.presence = set(stored)  # the filter holds what the leader holds
    core = make(leader)
    calls = len(leader.calls)
    cold = Request("cold", list(range(500, 521)))
    assert core.lookup(cold, 0) == (0, False)
    assert leader.calls[calls:] == [], "a ruled-out first block costs no PrepareLoad"
    assert leader.unasked_blocks == 5, "the leader is told the 5 blocks looked up (for its hit rates)"
    assert core.lookup(cold, 0) == (0, False) and leader.unasked_blocks == 5, "asked again: the same miss"
    # the first block asked for is the one after the local prefix: a stored prefix that the
    # filter admits goes to the leader, as without a filter
    warm = Request("warm", list(range(21)))
    assert core.lookup(warm, 1 * BS) == (4 * BS, False)
    assert leader.names()[calls:] == ["prepare_load"]


def test_a_filter_that_rules_out_a_stored_first_block_only_costs_the_hit():
    leader = FakeLeader()
    run_prefill(make(leader), Request("x", list(range(21))), [0, 1, 2, 3, 4, 5])
    leader.presence = set()  # (a reader racing a store: never more than a miss)
    core = make(leader)
    req = Request("y", list(range(21)))
    assert core.lookup(req, 0) == (0, False)
    core.allocated("y", [0, 1, 2, 3, 4, 5], 0)
    core.assign_blocks("y", [0, 1, 2, 3, 4, 5], replace=True)
    plan = core.step({"y": 21})
    assert plan.loads == [] and not leader.released


# ---------------------------------------------------------------------------- block holds
def holding(leader: FakeLeader, pool: FakePool) -> SchedulerCore:
    """A core whose engine pins the blocks its stores read (block_holds.py)."""
    core = make(leader)
    core.holds = BlockHolds(pool)
    return core


def test_a_finished_request_is_freed_at_once_and_its_stored_blocks_stay_pinned_until_settled():
    leader, pool = FakeLeader(), FakePool()
    core = holding(leader, pool)
    a = Request("a", list(range(13)))
    assert core.lookup(a, 0) == (0, False)
    core.assign_blocks("a", [7, 8, 9, 10], replace=True)
    plan = core.step({"a": 13})
    (store,) = plan.stores
    assert store.store_id > 0 and store.engine_blocks == [7, 8, 9]
    assert pool.pinned == {7, 8, 9} and core.holding
    assert core.finished("a") is False, "no delayed free: the pool holds what the store reads"
    assert core.step({}).delayed_frees == []
    core.stores_settled([store.store_id])
    assert pool.pinned == set() and not core.holding


def test_blocks_the_leader_already_has_are_not_pinned_past_the_answer():
    leader, pool = FakeLeader(), FakePool()
    core = holding(leader, pool)
    a, b = Request("a", list(range(9))), Request("b", list(range(9)))  # b: the same two blocks
    for r, blocks in ((a, [1, 2, 3]), (b, [4, 5, 6])):
        core.lookup(r, 0)
        core.assign_blocks(r.request_id, blocks, replace=True)
    core.step({"a": 9})
    plan = core.step({"b": 9})
    assert plan.stores == [], "b's blocks are stored already (a's)"
    assert pool.pinned == {1, 2}
    leader.down = True
    c = Request("c", list(range(50, 59)))
    core.lookup(c, 0)
    core.assign_blocks("c", [11, 12, 13], replace=True)
    assert core.step({"c": 9}).stores == []
    assert pool.pinned == {1, 2}, "a store the leader could not plan pins nothing"



def test_without_holds_a_finished_request_with_stores_waits_for_them():
    leader = FakeLeader()
    settings = ConnectorSettings("unix:/l", "unix:/w-{id}", "model|float16|4", 1.0, 1.0)
    core = SchedulerCore(BS, settings, leader, lambda r: r.extras)
    a = Request("a", list(range(13)))
    core.lookup(a, 0)
    core.assign_blocks("a", [7, 8, 9, 10], replace=True)
    assert core.step({"a": 13}).stores[0].store_id == 0
    assert core.finished("a") is True
    assert core.step({}).delayed_frees == ["a"]
