"""JobLedger and JobTable.start: plans bound to live leader state (issue 11 row 2, leader side),
bad copies reported by workers, and the one reset shared by a lost worker and a re-plan."""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine

import pytest

from kvbm_client.config import KvbmConfig
from kvbm_client.ids import BlockHash, JobId, SessionId, SlotId, Tier, WorkerId
from kvbm_leader.events import KvEventFeed, NullEvents
from kvbm_leader.jobs import JobState, JobTable, StartRefused
from kvbm_leader.ledger import JobLedger, PlanSigner
from kvbm_leader.membership import Layout, Membership, WorkerRecord
from kvbm_leader.metrics import LeaderMetrics
from kvbm_leader.placement import PlacementPolicy
from kvbm_leader.policies.frequency import FrequencyFilter
from kvbm_leader.refusals import Refused, Why

W0, W1 = WorkerId("0"), WorkerId("1")
S = SessionId("s")
HOST, DISK = Tier.HOST, Tier.DISK


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(8, "big"))


def keys(*ids: int) -> list[BlockHash]:
    return [key(i) for i in ids]


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


class Events(NullEvents):
    def __init__(self) -> None:
        self.removed_keys: list[BlockHash] = []

    def removed(self, keys_: Any) -> None:
        self.removed_keys.extend(keys_)


def make_ledger(workers: tuple[WorkerId, ...] = (W0, W1), host: int = 4, disk: int = 4,
                timeout: float = 10.0) -> tuple[JobLedger, Events]:
    config = KvbmConfig(cpu_cache_override_num_blocks=host, disk_cache_override_num_blocks=disk,
                        job_timeout_secs=timeout)
    membership = Membership(config, list(workers))
    for rank, w in enumerate(workers):
        membership.attach(WorkerRecord(w, rank, f"unix:/w{w}", 1, False))
        membership.set_layout(w, Layout(1, 4096, "u8", 8, rank))
    sizes = membership.replan()
    assert sizes is not None
    placement = PlacementPolicy({HOST: sizes.host_slots, DISK: sizes.disk_slots},
                                FrequencyFilter(100, enabled=False))
    events = Events()
    return JobLedger(config, placement, membership, LeaderMetrics(), KvEventFeed(events),
                     PlanSigner("leader-test", b"k" * 32)), events


async def stored(ledger: JobLedger, *ids: int) -> None:
    """Blocks ``ids`` ready in G2 (every worker confirmed)."""
    plan = ledger.placement.prepare_store(ledger.jobs.next_id(), keys(*ids))
    job, _ = ledger.new(plan, S)
    for w in job.expected:
        await ledger.report(job.job_id, w, True, "")


def free(ledger: JobLedger, tier: Tier = HOST) -> int:
    return ledger.placement.registry.pools[tier].allocator.num_free


def epoch(ledger: JobLedger) -> int:
    assert ledger.membership.pools is not None
    return ledger.membership.pools.epoch


# --------------------------------------------------------------------------- JobTable.start
@pytest.mark.parametrize("case, expected", [
    ("live", None),
    ("unknown", StartRefused.NOT_LIVE),
    ("stranger", StartRefused.NOT_EXPECTED),
    ("failed", StartRefused.FAILED),
    ("late", StartRefused.LATE),
])
def test_job_table_start(case: str, expected: StartRefused | None) -> None:
    ledger, _ = make_ledger()
    table: JobTable = ledger.jobs
    job, _ = ledger.new(ledger.placement.prepare_store(table.next_id(), keys(1)), S)
    job_id, worker, now = job.job_id, W0, job.deadline - 1
    if case == "unknown":
        job_id = JobId(999)
    elif case == "stranger":
        worker = WorkerId("9")
    elif case == "failed":
        table.fail(job.job_id, "released")
    elif case == "late":
        now = job.deadline
    answer = table.start(job_id, worker, now)
    if expected is None:
        assert answer is job and job.started == {W0}
    else:
        assert answer is expected and job.started == set()


# --------------------------------------------------------------------------- ledger.start
def test_start_refuses_another_epoch_and_a_job_of_a_previous_leader() -> None:
    ledger, _ = make_ledger()
    job, _ = ledger.new(ledger.placement.prepare_store(ledger.jobs.next_id(), keys(1)), S)
    with pytest.raises(Refused) as info:
        ledger.start(job.job_id, W0, epoch(ledger) + 1, 0.0)
    assert info.value.why is Why.NOT_LIVE
    # A restarted leader knows none of the old leader's jobs (its ledger starts empty).
    restarted, _ = make_ledger()
    with pytest.raises(Refused) as info:
        restarted.start(job.job_id, W0, epoch(restarted), 0.0)
    assert info.value.why is Why.NOT_LIVE
    with pytest.raises(Refused) as info:
        ledger.start(job.job_id, W0, epoch(ledger), job.deadline + 1)
    assert info.value.why is Why.LATE
    assert ledger.start(job.job_id, W0, epoch(ledger), 0.0) is job


# --------------------------------------------------------------------------- release / expiry
def test_release_of_an_unstarted_load_unpins_at_once() -> None:
    ledger, _ = make_ledger()
    run(stored(ledger, 1))
    load, _ = ledger.new(ledger.placement.prepare_load(ledger.jobs.next_id(), keys(1)), S)
    assert ledger.placement.registry.get(key(1)).pins == 1
    run(ledger.release(load, "released by client"))
    assert ledger.jobs.get(load.job_id) is None
    assert ledger.placement.registry.get(key(1)).pins == 0
    with pytest.raises(Refused):  # a replayed plan of it may not start
        ledger.start(load.job_id, W0, epoch(ledger), 0.0)


@pytest.mark.parametrize("end", ["release", "session-expired"])
def test_a_started_load_keeps_its_slots_until_its_worker_reported(end: str) -> None:
    ledger, _ = make_ledger()
    run(stored(ledger, 1))
    load, _ = ledger.new(ledger.placement.prepare_load(ledger.jobs.next_id(), keys(1)), S)
    ledger.start(load.job_id, W0, epoch(ledger), 0.0)
    if end == "release":
        run(ledger.release(load, "released by client"))
    else:
        run(ledger.end_session(S, "session expired"))
    assert ledger.jobs.get(load.job_id) is load and load.state is JobState.FAILED
    assert ledger.placement.registry.get(key(1)).pins == 1, "a copy may still read the slot"
    with pytest.raises(Refused) as info:  # the other worker may not start it any more
        ledger.start(load.job_id, W1, epoch(ledger), 0.0)
    assert info.value.why is Why.NOT_LIVE
    run(ledger.report(load.job_id, W0, True, ""))
    assert ledger.jobs.get(load.job_id) is load, "worker 1 never started, but has not reported either"
    run(ledger.expire(load.expires))
    assert ledger.jobs.get(load.job_id) is None
    assert ledger.placement.registry.get(key(1)).pins == 0
    assert ledger.metrics.values["kvbm_onboard_blocks_h2d"] == 0


def test_a_released_store_keeps_its_slots_until_expiry() -> None:
    ledger, _ = make_ledger(host=2)
    store, _ = ledger.new(ledger.placement.prepare_store(ledger.jobs.next_id(), keys(1, 2)), S)
    run(ledger.release(store, "released by client"))
    assert free(ledger) == 0, "a worker told to copy may still write these slots"
    run(ledger.expire(store.deadline))  # inside the grace
    assert free(ledger) == 0
    run(ledger.expire(store.expires))
    assert free(ledger) == 2
    assert ledger.metrics.values["kvbm_failed_jobs"] == 1


def test_fail_all_counts_every_job() -> None:
    ledger, _ = make_ledger()
    for i in range(3):
        ledger.new(ledger.placement.prepare_store(ledger.jobs.next_id(), keys(i)), S)
    assert ledger.fail_all() == 3
    assert len(ledger.jobs) == 0 and ledger.metrics.values["kvbm_failed_jobs"] == 3


# --------------------------------------------------------------------------- bad copies
def test_a_failed_load_with_bad_slots_drops_exactly_those_copies() -> None:
    ledger, events = make_ledger()
    run(stored(ledger, 1, 2, 3))
    load, _ = ledger.new(ledger.placement.prepare_load(ledger.jobs.next_id(), keys(1, 2, 3)), S)
    bad_slot = load.placement.slots[1]
    run(ledger.report(load.job_id, W0, False, "checksum mismatch", [(HOST, bad_slot)]))
    run(ledger.report(load.job_id, W1, True, ""))
    reg = ledger.placement.registry
    assert reg.get(key(2)) is None, "the bad copy is never matched again"
    assert reg.get(key(1)).ready_in(HOST) and reg.get(key(3)).ready_in(HOST)
    assert ledger.metrics.values["kvbm_corrupt_blocks"] == 1
    assert key(2) in events.removed_keys
    assert reg.owner(HOST, bad_slot) is None and free(ledger) == 2  # its slot is free again


def test_a_failed_load_without_bad_slots_keeps_the_copy() -> None:
    ledger, _ = make_ledger()
    run(stored(ledger, 1))
    load, _ = ledger.new(ledger.placement.prepare_load(ledger.jobs.next_id(), keys(1)), S)
    run(ledger.report(load.job_id, W0, False, "io error"))
    run(ledger.report(load.job_id, W1, True, ""))
    assert ledger.placement.registry.get(key(1)).ready_in(HOST)


def test_a_bad_copy_another_load_still_reads_is_freed_when_that_load_ends() -> None:
    ledger, _ = make_ledger()
    run(stored(ledger, 1))
    first, _ = ledger.new(ledger.placement.prepare_load(ledger.jobs.next_id(), keys(1)), S)
    second, _ = ledger.new(ledger.placement.prepare_load(ledger.jobs.next_id(), keys(1)), S)
    slot = first.placement.slots[0]
    run(ledger.report(first.job_id, W0, False, "short read", [(HOST, slot)]))
    run(ledger.report(first.job_id, W1, True, ""))
    reg = ledger.placement.registry
    assert ledger.placement.match(keys(1), count_hit=False).num_matched == 0
    assert reg.owner(HOST, slot) == key(1), "the second load still reads it: the slot is not reused"
    run(ledger.report(second.job_id, W0, True, ""))
    run(ledger.report(second.job_id, W1, True, ""))
    assert reg.get(key(1)) is None and reg.owner(HOST, slot) is None


def test_bad_slots_of_a_store_reported_ok_are_not_committed() -> None:
    ledger, _ = make_ledger()
    plan = ledger.placement.prepare_store(ledger.jobs.next_id(), keys(1, 2))
    job, _ = ledger.new(plan, S)
    run(ledger.report(job.job_id, W0, True, "", [(HOST, plan.slots[0])]))
    run(ledger.report(job.job_id, W1, True, ""))
    assert ledger.placement.match(keys(1, 2), count_hit=False).num_matched == 0
    assert ledger.placement.match(keys(2), count_hit=False).num_matched == 1
    assert ledger.metrics.values["kvbm_offload_blocks_d2h"] == 1


def test_a_bad_slot_not_in_the_job_is_ignored() -> None:
    ledger, _ = make_ledger()
    run(stored(ledger, 1, 2))
    load, _ = ledger.new(ledger.placement.prepare_load(ledger.jobs.next_id(), keys(1)), S)
    other = ledger.placement.registry.get(key(2)).copies[HOST].slot
    run(ledger.report(load.job_id, W0, False, "?", [(HOST, other), (DISK, SlotId(3))]))
    assert ledger.placement.registry.get(key(2)).ready_in(HOST)
    assert ledger.metrics.values["kvbm_corrupt_blocks"] == 0


# --------------------------------------------------------------------------- late stores (issue 17 window 2)
def test_a_store_reported_after_its_deadline_is_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine takes a store's blocks back once its connector stopped waiting (the plan's
    deadline plus a margin): a copy reported after the deadline may have read reused blocks."""
    import kvbm_leader.ledger as ledger_module

    ledger, _ = make_ledger(workers=(W0,), host=2)
    store, _ = ledger.new(ledger.placement.prepare_store(ledger.jobs.next_id(), keys(1, 2)), S)
    now = store.deadline + 0.001
    monkeypatch.setattr(ledger_module.time, "monotonic", lambda: now)
    assert run(ledger.report(store.job_id, W0, True, "")) is JobState.FAILED
    assert ledger.placement.match(keys(1, 2), False).num_matched == 0, "a late store was committed"
    assert free(ledger) == 2 and ledger.metrics.values["kvbm_failed_jobs"] == 1


def test_a_store_reported_before_its_deadline_is_committed() -> None:
    ledger, _ = make_ledger(workers=(W0,), host=2)
    store, _ = ledger.new(ledger.placement.prepare_store(ledger.jobs.next_id(), keys(1, 2)), S)
    assert run(ledger.report(store.job_id, W0, True, "")) is JobState.CONFIRMED
    assert ledger.placement.match(keys(1, 2), False).num_matched == 2
