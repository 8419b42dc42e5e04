"""PlacementPolicy + BlockRegistry: the two-phase placement protocol, eviction and demotion."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from kvbm_client.ids import BlockHash, JobId, PlanKind, SlotId, Tier
from kvbm_client.contract import MatchResult
from kvbm_leader.placement import JobPlacement, PlacementPolicy, store_demotion_limit
from kvbm_leader.policies.frequency import FrequencyFilter

HOST, DISK = Tier.HOST, Tier.DISK


# --------------------------------------------------------------------------- helpers
def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(8, "big"))


def keys(*ids: int) -> list[BlockHash]:
    return [key(i) for i in ids]


_job_ids = itertools.count(1)


def next_job() -> JobId:
    return JobId(next(_job_ids))


def make_manager(host: int = 0, disk: int = 0, filter_enabled: bool = True) -> PlacementPolicy:
    return PlacementPolicy({HOST: host, DISK: disk}, FrequencyFilter(max_entries=1000, enabled=filter_enabled))


def store(tm: PlacementPolicy, *ids: int, success: bool = True) -> JobPlacement:
    """prepare_store + complete: the blocks are ready (or rolled back) afterwards."""
    plan = tm.prepare_store(next_job(), keys(*ids))
    tm.complete(plan, success)
    return plan


def make_frequent(tm: PlacementPolicy, *ids: int) -> None:
    """A prefix hit doubles each block's frequency (1 -> 2), as a scheduler's lookup does."""
    for i in ids:
        assert tm.match(keys(i), count_hit=True).num_matched == 1
        assert tm.frequency.frequency(key(i)) >= 2


def copies(tm: PlacementPolicy, i: int) -> dict[Tier, bool]:
    """Tier -> is_ready of every copy of block ``i`` ({} when unknown)."""
    entry = tm.registry.get(key(i))
    return {} if entry is None else {t: c.is_ready for t, c in entry.copies.items()}


def lru_order(tm: PlacementPolicy, tier: Tier) -> list[int]:
    return [int.from_bytes(k, "big") for k in tm.registry.pools[tier].lru.candidates()]


def snapshot(tm: PlacementPolicy) -> dict:
    """Everything observable of the registry, to check that a prepare changed nothing."""
    reg = tm.registry
    return {
        "blocks": {k: ({t: (c.slot, c.job) for t, c in e.copies.items()}, e.pins, e.busy_job)
                   for k, e in reg.blocks.items()},
        "free": {t: p.allocator.num_free for t, p in reg.pools.items()},
        "lru": {t: list(p.lru.candidates()) for t, p in reg.pools.items()},
    }


@dataclass
class ExpectedPlan:
    keys: list[int] = field(default_factory=list)
    tiers: list[Tier] = field(default_factory=list)
    indices: list[int] | None = None
    demoted: list[int] = field(default_factory=list)
    skipped_present: int = 0
    skipped_full: int = 0
    dropped: int = 0


def verify_plan(plan: JobPlacement, expected: ExpectedPlan) -> None:
    assert [int.from_bytes(k, "big") for k in plan.keys] == expected.keys
    assert plan.tiers == expected.tiers
    assert len(plan.slots) == len(plan.keys)
    assert len(set(zip(plan.tiers, plan.slots))) == len(plan.slots), "a slot handed out twice"
    if expected.indices is not None:
        assert plan.indices == expected.indices
    assert [int.from_bytes(d.key, "big") for d in plan.demotions] == expected.demoted
    assert (plan.skipped_present, plan.skipped_full, plan.dropped) == (
        expected.skipped_present, expected.skipped_full, expected.dropped)


# --------------------------------------------------------------------------- store
def test_store_tier_prefers_host_then_disk() -> None:
    assert make_manager(host=2, disk=2).store_tier is HOST
    assert make_manager(host=0, disk=2).store_tier is DISK
    assert make_manager().store_tier is None


def test_prepare_store_reserves_pending_copies_matchable_only_after_success() -> None:
    tm = make_manager(host=4)
    job = next_job()

    plan = tm.prepare_store(job, keys(1, 2, 3))

    assert plan.kind is PlanKind.STORE and plan.job_id == job
    verify_plan(plan, ExpectedPlan(keys=[1, 2, 3], tiers=[HOST] * 3, indices=[0, 1, 2]))
    assert plan.slots == [0, 1, 2]
    assert tm.registry.used(HOST) == 3
    assert all(copies(tm, i) == {HOST: False} for i in (1, 2, 3))
    assert tm.match(keys(1, 2, 3), count_hit=False) == MatchResult(0, ())
    assert tm.prepare_load(next_job(), keys(1)).keys == []  # pending copies are not loadable

    outcome = tm.complete(plan, success=True)

    assert outcome.stored == {HOST: 3, DISK: 0}
    assert (outcome.demoted, outcome.loaded) == (0, {HOST: 0, DISK: 0})
    assert tm.match(keys(1, 2, 3), count_hit=False) == MatchResult(3, (HOST, HOST, HOST))


def test_prepare_store_records_parents() -> None:
    tm = make_manager(host=4)
    tm.prepare_store(next_job(), keys(1, 2), parents=[None, key(1)])
    assert tm.registry.get(key(1)).parent is None
    assert tm.registry.get(key(2)).parent == key(1)


def test_prepare_store_counts_each_later_sight() -> None:
    tm = make_manager(host=4)
    store(tm, 1)
    assert tm.frequency.frequency(key(1)) == 1  # first sight
    store(tm, 1)  # present: skipped, but offered again -> a later sight doubles it
    assert tm.frequency.frequency(key(1)) == 2
    tm.prepare_store(next_job(), keys(1, 1))  # a duplicate within one request counts once
    assert tm.frequency.frequency(key(1)) == 4


@pytest.mark.parametrize("pending", [True, False], ids=["pending", "ready"])
def test_duplicates_and_present_blocks_are_skipped_present(pending: bool) -> None:
    tm = make_manager(host=8)
    first = tm.prepare_store(next_job(), keys(1, 2))
    if not pending:
        tm.complete(first, True)

    plan = tm.prepare_store(next_job(), keys(1, 3, 3, 2, 4))

    verify_plan(plan, ExpectedPlan(keys=[3, 4], tiers=[HOST, HOST], indices=[1, 4], skipped_present=3))
    assert tm.registry.used(HOST) == 4
    # The present copies still belong to the first job.
    assert tm.registry.get(key(1)).copies[HOST].job == (first.job_id if pending else None)


@pytest.mark.parametrize("blocker", ["pinned", "pending", "demoting"])
def test_full_tier_of_unevictable_blocks_skips_full_and_changes_nothing(blocker: str) -> None:
    tm = make_manager(host=2, disk=4)
    if blocker == "pending":
        tm.prepare_store(next_job(), keys(1, 2))
    else:
        store(tm, 1, 2)
        if blocker == "pinned":
            assert len(tm.prepare_load(next_job(), keys(1, 2)).keys) == 2
        else:
            make_frequent(tm, 1, 2)
            assert len(tm.prepare_demotion(next_job(), free_target=2).demotions) == 2
    assert tm.registry.pools[DISK].allocator.num_free >= 2  # G3 has room; G2 must still refuse
    before = snapshot(tm)

    plan = tm.prepare_store(next_job(), keys(3, 4))

    verify_plan(plan, ExpectedPlan(skipped_full=2))
    assert plan.is_empty
    assert snapshot(tm) == before


def test_no_tier_configured_skips_everything_full() -> None:
    tm = make_manager()
    plan = tm.prepare_store(next_job(), keys(1, 2))
    verify_plan(plan, ExpectedPlan(skipped_full=2))


# --------------------------------------------------------------------------- eviction
def test_lru_eviction_order_host_only() -> None:
    tm = make_manager(host=3)
    store(tm, 1, 2, 3)
    tm.match(keys(1), count_hit=True)  # a hit makes 1 most recently used
    assert lru_order(tm, HOST) == [2, 3, 1]

    plan = store(tm, 4)
    verify_plan(plan, ExpectedPlan(keys=[4], tiers=[HOST], dropped=1))
    assert copies(tm, 2) == {} and tm.registry.get(key(2)) is None

    plan = store(tm, 5)
    verify_plan(plan, ExpectedPlan(keys=[5], tiers=[HOST], dropped=1))
    assert copies(tm, 3) == {}
    assert lru_order(tm, HOST) == [1, 4, 5]
    assert tm.match(keys(1), count_hit=False).num_matched == 1


def test_evicted_slot_is_reused_by_the_new_block() -> None:
    tm = make_manager(host=2)
    store(tm, 1, 2)
    slot_of_1 = tm.registry.get(key(1)).copies[HOST].slot

    plan = tm.prepare_store(next_job(), keys(3))

    assert plan.slots == [slot_of_1]
    assert tm.registry.used(HOST) == 2


def test_match_without_hit_does_not_touch_lru_or_frequency() -> None:
    tm = make_manager(host=3)
    store(tm, 1, 2, 3)

    result = tm.match(keys(1, 2, 9, 3), count_hit=False)

    assert result == MatchResult(2, (HOST, HOST))  # stops at the first miss
    assert lru_order(tm, HOST) == [1, 2, 3]
    assert tm.frequency.frequency(key(1)) == 1


@pytest.mark.parametrize("filter_enabled", [True, False], ids=["filter", "no-filter"])
def test_host_eviction_demotes_frequent_blocks_in_the_store_plan(filter_enabled: bool) -> None:
    tm = make_manager(host=2, disk=4, filter_enabled=filter_enabled)
    store(tm, 1, 2)
    make_frequent(tm, 2)  # LRU order now [1, 2]; 1 was seen once, 2 was hit
    host_slots = {i: tm.registry.get(key(i)).copies[HOST].slot for i in (1, 2)}

    plan = tm.prepare_store(next_job(), keys(3, 4))

    if filter_enabled:
        verify_plan(plan, ExpectedPlan(keys=[3, 4], tiers=[HOST, HOST], demoted=[2], dropped=1))
        assert copies(tm, 1) == {}  # a one-off block is dropped
    else:
        verify_plan(plan, ExpectedPlan(keys=[3, 4], tiers=[HOST, HOST], demoted=[1, 2]))
        assert copies(tm, 1) == {DISK: False}
    demo = {int.from_bytes(d.key, "big"): d for d in plan.demotions}
    assert demo[2].host_slot == host_slots[2]
    assert demo[2].host_slot in plan.slots  # the freed G2 slot is handed on within the plan
    assert copies(tm, 2) == {DISK: False}  # pending on G3, gone from G2
    assert tm.match(keys(2), count_hit=False).num_matched == 0
    assert tm.registry.used(DISK) == len(plan.demotions)

    outcome = tm.complete(plan, success=True)

    assert outcome.demoted == len(plan.demotions)
    assert outcome.stored == {HOST: 2, DISK: 0}
    assert tm.match(keys(2), count_hit=False) == MatchResult(1, (DISK,))
    assert tm.match(keys(1), count_hit=False).num_matched == (0 if filter_enabled else 1)


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_a_store_carries_at_most_its_demotion_limit_and_drops_the_rest(limit: int) -> None:
    """A store's demotions make the engine's blocks wait for the disk: past the limit the
    evicted blocks are dropped, counted apart from blocks the filter did not want."""
    tm = make_manager(host=3, disk=8, filter_enabled=False)
    tm.store_demotion_limit = limit
    store(tm, 1, 2, 3)  # LRU order [1, 2, 3], every one worth G3 (filter off)

    plan = tm.prepare_store(next_job(), keys(4, 5, 6))

    verify_plan(plan, ExpectedPlan(keys=[4, 5, 6], tiers=[HOST] * 3, demoted=[1, 2, 3][:limit], dropped=3 - limit))
    assert plan.skipped_demotions == 3 - limit
    tm.complete(plan, success=True)
    assert [copies(tm, i) for i in (1, 2, 3)] == [{DISK: True}] * limit + [{}] * (3 - limit)


def test_the_demotion_limit_binds_stores_only() -> None:
    """Background demotion and promotion are the leader's own jobs: no engine block waits on them."""
    tm = make_demotable(filter_enabled=False)
    tm.store_demotion_limit = 0
    plan = tm.prepare_demotion(next_job(), free_target=4)
    assert len(plan.demotions) == 4 and plan.skipped_demotions == 0


def test_a_block_the_filter_drops_is_not_a_skipped_demotion() -> None:
    tm = make_manager(host=2, disk=4, filter_enabled=True)
    tm.store_demotion_limit = 0
    store(tm, 1, 2)
    make_frequent(tm, 2)
    plan = tm.prepare_store(next_job(), keys(3, 4))
    verify_plan(plan, ExpectedPlan(keys=[3, 4], tiers=[HOST, HOST], dropped=2))
    assert plan.skipped_demotions == 1  # 2 was worth G3; 1 was a one-off


@pytest.mark.parametrize("budget_mb,block_bytes,expected", [
    (64.0, 2_359_296, 27), (64.0, 8192, 7812), (0.0, 8192, 0), (-1.0, 8192, None), (64.0, 0, None)])
def test_store_demotion_limit_from_the_budget(budget_mb: float, block_bytes: int, expected: int | None) -> None:
    assert store_demotion_limit(budget_mb, block_bytes) == expected


def test_demotion_evicts_from_disk_lru_when_disk_is_full() -> None:
    tm = make_manager(host=1, disk=1, filter_enabled=False)
    store(tm, 1)
    store(tm, 2)  # 1 demoted to the only disk slot
    assert copies(tm, 1) == {DISK: True}

    plan = store(tm, 3)  # 2 needs the disk slot: 1 is dropped from G3

    verify_plan(plan, ExpectedPlan(keys=[3], tiers=[HOST], demoted=[2], dropped=1))
    assert copies(tm, 1) == {}
    assert copies(tm, 2) == {DISK: True}
    assert copies(tm, 3) == {HOST: True}


def test_demotion_falls_back_to_drop_when_disk_is_unavailable() -> None:
    tm = make_manager(host=1, disk=1, filter_enabled=False)
    store(tm, 1)
    store(tm, 2)  # 1 on disk
    assert len(tm.prepare_load(next_job(), keys(1)).keys) == 1  # pinned: disk has no victim

    plan = store(tm, 3)

    verify_plan(plan, ExpectedPlan(keys=[3], tiers=[HOST], dropped=1))
    assert copies(tm, 2) == {}
    assert copies(tm, 1) == {DISK: True}


def test_frequent_block_already_on_disk_is_not_demoted_again() -> None:
    tm = make_manager(host=1, disk=4, filter_enabled=False)
    store(tm, 1)
    store(tm, 2)  # 1 -> G3
    store(tm, 1)  # 1 back in G2 (2 -> G3); now on both tiers
    assert copies(tm, 1) == {HOST: True, DISK: True}

    plan = store(tm, 3)

    assert plan.demotions == []
    assert copies(tm, 1) == {DISK: True}
    assert tm.registry.used(DISK) == 2


def test_evicting_a_host_copy_backed_by_disk_is_not_counted_as_dropped() -> None:
    tm = make_manager(host=1, disk=4, filter_enabled=False)
    store(tm, 1)
    store(tm, 2)
    store(tm, 1)
    assert copies(tm, 1) == {HOST: True, DISK: True}

    plan = store(tm, 3)

    assert plan.dropped == 0


def test_disk_only_mode_stores_straight_to_disk() -> None:
    tm = make_manager(host=0, disk=2, filter_enabled=False)
    assert HOST not in tm.registry.pools

    plan = tm.prepare_store(next_job(), keys(1, 2))
    verify_plan(plan, ExpectedPlan(keys=[1, 2], tiers=[DISK, DISK]))
    outcome = tm.complete(plan, True)

    assert outcome.stored == {HOST: 0, DISK: 2}
    assert tm.match(keys(1, 2), count_hit=True) == MatchResult(2, (DISK, DISK))

    plan = store(tm, 3)  # full: LRU eviction on disk, no demotion anywhere
    verify_plan(plan, ExpectedPlan(keys=[3], tiers=[DISK], dropped=1))
    assert copies(tm, 1) == {}
    assert copies(tm, 3) == {DISK: True}


def test_disk_only_mode_never_evicts_pinned_blocks() -> None:
    tm = make_manager(disk=1)
    store(tm, 1)
    load = tm.prepare_load(next_job(), keys(1))
    assert load.tiers == [DISK]

    verify_plan(tm.prepare_store(next_job(), keys(2)), ExpectedPlan(skipped_full=1))
    tm.complete(load, True)
    verify_plan(store(tm, 2), ExpectedPlan(keys=[2], tiers=[DISK], dropped=1))


# --------------------------------------------------------------------------- load
def make_two_tier_state() -> PlacementPolicy:
    """G2 = {4, 1}, G3 = {1, 2, 3}: block 1 on both tiers, 2 and 3 only on disk."""
    tm = make_manager(host=2, disk=4, filter_enabled=False)
    store(tm, 1, 2)
    store(tm, 3, 4)  # 1, 2 -> G3
    store(tm, 1)  # 3 -> G3; 1 back in G2
    assert copies(tm, 1) == {HOST: True, DISK: True}
    assert copies(tm, 2) == {DISK: True} and copies(tm, 3) == {DISK: True}
    assert copies(tm, 4) == {HOST: True}
    return tm


def test_prepare_load_pins_longest_ready_prefix_preferring_host() -> None:
    tm = make_two_tier_state()

    plan = tm.prepare_load(next_job(), keys(1, 2, 4, 9, 3))

    assert plan.kind is PlanKind.LOAD
    assert [int.from_bytes(k, "big") for k in plan.keys] == [1, 2, 4]
    assert plan.tiers == [HOST, DISK, HOST]
    assert plan.slots == [tm.registry.get(key(1)).copies[HOST].slot,
                          tm.registry.get(key(2)).copies[DISK].slot,
                          tm.registry.get(key(4)).copies[HOST].slot]
    assert [tm.registry.get(key(i)).pins for i in (1, 2, 4, 3)] == [1, 1, 1, 0]


def test_prepare_load_of_unknown_first_block_plans_nothing() -> None:
    tm = make_two_tier_state()
    plan = tm.prepare_load(next_job(), keys(9, 1))
    assert plan.keys == [] and plan.is_empty
    assert tm.registry.get(key(1)).pins == 0


def test_pinned_blocks_are_never_evicted_and_complete_unpins() -> None:
    tm = make_manager(host=2)
    store(tm, 1, 2)
    load = tm.prepare_load(next_job(), keys(1))

    verify_plan(store(tm, 3, 4), ExpectedPlan(keys=[3], tiers=[HOST], skipped_full=1, dropped=1))
    assert copies(tm, 1) == {HOST: True}
    assert copies(tm, 2) == {}

    outcome = tm.complete(load, success=True)

    assert outcome.loaded == {HOST: 1, DISK: 0}
    assert tm.registry.get(key(1)).pins == 0
    # NOTE: a load's end is the block's last use (as in vLLM's free queue): 1 is evictable
    # again, most recently used, so 3 goes first, then 1.
    verify_plan(store(tm, 5), ExpectedPlan(keys=[5], tiers=[HOST], dropped=1))
    assert copies(tm, 3) == {} and copies(tm, 1) == {HOST: True}
    verify_plan(store(tm, 6), ExpectedPlan(keys=[6], tiers=[HOST], dropped=1))
    assert copies(tm, 1) == {}  # LRU victim once unpinned


def test_load_pins_are_counted() -> None:
    tm = make_manager(host=1)
    store(tm, 1)
    first = tm.prepare_load(next_job(), keys(1))
    second = tm.prepare_load(next_job(), keys(1))
    assert tm.registry.get(key(1)).pins == 2
    assert tm.registry.count_pinned(HOST) == 1

    tm.complete(first, True)
    verify_plan(tm.prepare_store(next_job(), keys(2)), ExpectedPlan(skipped_full=1))
    tm.complete(second, True)
    assert tm.registry.get(key(1)).pins == 0
    assert tm.registry.count_pinned(HOST) == 0


def test_failed_load_unpins_and_counts_nothing() -> None:
    tm = make_two_tier_state()
    plan = tm.prepare_load(next_job(), keys(1, 2))

    outcome = tm.complete(plan, success=False)

    assert outcome.loaded == {HOST: 0, DISK: 0}
    assert all(tm.registry.get(key(i)).pins == 0 for i in (1, 2))
    assert tm.match(keys(1, 2), count_hit=False).num_matched == 2  # a failed load keeps the data


def test_load_touches_lru() -> None:
    tm = make_manager(host=3)
    store(tm, 1, 2, 3)
    tm.complete(tm.prepare_load(next_job(), keys(1)), True)
    assert lru_order(tm, HOST) == [2, 3, 1]


# --------------------------------------------------------------------------- rollback
def test_failed_store_rolls_back_slot_and_block() -> None:
    tm = make_manager(host=2)
    store(tm, 1)
    before = snapshot(tm)

    plan = tm.prepare_store(next_job(), keys(2))
    outcome = tm.complete(plan, success=False)

    assert outcome.stored == {HOST: 0, DISK: 0}
    assert tm.registry.get(key(2)) is None
    assert snapshot(tm) == before
    assert tm.registry.pools[HOST].allocator.num_free == 1
    verify_plan(store(tm, 3), ExpectedPlan(keys=[3], tiers=[HOST]))  # the slot is usable again


def test_failed_store_with_demotion_frees_every_reserved_slot() -> None:
    tm = make_manager(host=1, disk=2, filter_enabled=False)
    store(tm, 1)

    plan = tm.prepare_store(next_job(), keys(2))
    assert len(plan.demotions) == 1
    outcome = tm.complete(plan, success=False)

    assert (outcome.stored[HOST], outcome.demoted) == (0, 0)
    assert tm.registry.blocks == {}
    assert tm.registry.used(HOST) == 0 and tm.registry.used(DISK) == 0


def test_complete_ignores_copies_of_another_job() -> None:
    tm = make_manager(host=2)
    plan = tm.prepare_store(next_job(), keys(1))
    stranger = JobPlacement(next_job(), PlanKind.STORE, keys=keys(1), tiers=[HOST], slots=[SlotId(0)])

    assert tm.complete(stranger, success=False).stored[HOST] == 0
    assert copies(tm, 1) == {HOST: False}  # the real job's pending copy survives
    assert tm.complete(plan, True).stored[HOST] == 1
    assert tm.complete(plan, True).stored[HOST] == 0  # settling twice counts once


# --------------------------------------------------------------------------- background demotion
def make_demotable(filter_enabled: bool = True) -> PlacementPolicy:
    """G2 (4 slots) full of 1..4 with 1 and 2 frequent; LRU order [3, 4, 1, 2]."""
    tm = make_manager(host=4, disk=4, filter_enabled=filter_enabled)
    store(tm, 1, 2, 3, 4)
    make_frequent(tm, 1, 2)
    assert lru_order(tm, HOST) == [3, 4, 1, 2]
    return tm


@pytest.mark.parametrize("filter_enabled", [True, False], ids=["filter", "no-filter"])
def test_prepare_demotion_keeps_host_copy_readable_until_commit(filter_enabled: bool) -> None:
    tm = make_demotable(filter_enabled)
    job = next_job()

    plan = tm.prepare_demotion(job, free_target=4)

    demoted = [1, 2] if filter_enabled else [3, 4, 1, 2]
    assert plan.kind is PlanKind.DEMOTE and plan.keys == []
    verify_plan(plan, ExpectedPlan(demoted=demoted, dropped=4 - len(demoted)))
    for d in plan.demotions:
        assert d.host_slot == tm.registry.get(d.key).copies[HOST].slot
    for i in demoted:
        assert copies(tm, i) == {HOST: True, DISK: False}
        assert tm.registry.get(key(i)).busy_job == job
    assert tm.match(keys(*demoted), count_hit=False).tiers == (HOST,) * len(demoted)
    assert tm.registry.pools[HOST].allocator.num_free == 4 - len(demoted)

    outcome = tm.complete(plan, success=True)

    assert outcome.demoted == len(demoted)
    assert tm.registry.pools[HOST].allocator.num_free == 4
    for i in demoted:
        assert copies(tm, i) == {DISK: True}
        assert tm.registry.get(key(i)).busy_job is None
    assert tm.match(keys(*demoted), count_hit=False).tiers == (DISK,) * len(demoted)


def test_blocks_being_demoted_are_not_evicted() -> None:
    tm = make_demotable()
    tm.prepare_demotion(next_job(), free_target=4)  # 3, 4 dropped; 1, 2 busy

    plan = tm.prepare_store(next_job(), keys(5, 6, 7))

    verify_plan(plan, ExpectedPlan(keys=[5, 6], tiers=[HOST, HOST], skipped_full=1))
    assert copies(tm, 1) == {HOST: True, DISK: False}


def test_failed_demotion_keeps_the_host_copy_and_frees_the_disk_slot() -> None:
    tm = make_demotable()
    plan = tm.prepare_demotion(next_job(), free_target=4)

    outcome = tm.complete(plan, success=False)

    assert outcome.demoted == 0
    assert copies(tm, 1) == {HOST: True} and copies(tm, 2) == {HOST: True}
    assert tm.registry.get(key(1)).busy_job is None
    assert tm.registry.used(DISK) == 0
    verify_plan(store(tm, 5), ExpectedPlan(keys=[5], tiers=[HOST], dropped=0))  # free slot
    verify_plan(store(tm, 6, 7), ExpectedPlan(keys=[6, 7], tiers=[HOST, HOST], demoted=[1],
                                              dropped=0, skipped_full=0))


def test_demotion_commit_keeps_host_copy_of_a_pinned_block() -> None:
    tm = make_demotable()
    plan = tm.prepare_demotion(next_job(), free_target=4)
    load = tm.prepare_load(next_job(), keys(1))
    assert load.tiers == [HOST]

    tm.complete(plan, success=True)

    assert copies(tm, 1) == {HOST: True, DISK: True}
    assert copies(tm, 2) == {DISK: True}
    tm.complete(load, True)
    assert tm.registry.get(key(1)).pins == 0


@pytest.mark.parametrize("free_target, expected_dropped", [(0, 0), (1, 1), (2, 2)])
def test_prepare_demotion_stops_at_the_target(free_target: int, expected_dropped: int) -> None:
    tm = make_demotable()
    plan = tm.prepare_demotion(next_job(), free_target=free_target)
    verify_plan(plan, ExpectedPlan(dropped=expected_dropped))
    assert tm.registry.pools[HOST].allocator.num_free == expected_dropped


def test_prepare_demotion_respects_scan_limit() -> None:
    tm = make_demotable()
    plan = tm.prepare_demotion(next_job(), free_target=4, scan_limit=1)
    verify_plan(plan, ExpectedPlan(dropped=1))
    assert copies(tm, 3) == {} and copies(tm, 4) == {HOST: True}


def test_prepare_demotion_without_host_tier_is_empty() -> None:
    tm = make_manager(disk=2)
    store(tm, 1)
    plan = tm.prepare_demotion(next_job(), free_target=2)
    assert plan.is_empty and plan.dropped == 0


def test_prepare_demotion_without_disk_drops_lru_blocks() -> None:
    tm = make_manager(host=3, filter_enabled=False)
    store(tm, 1, 2, 3)
    plan = tm.prepare_demotion(next_job(), free_target=2)
    verify_plan(plan, ExpectedPlan(dropped=2))
    assert [copies(tm, i) for i in (1, 2, 3)] == [{}, {}, {HOST: True}]


# --------------------------------------------------------------------------- reset
def test_reset_drops_everything() -> None:
    tm = make_two_tier_state()
    pending = tm.prepare_store(next_job(), keys(7))
    load = tm.prepare_load(next_job(), keys(1))

    assert tm.reset() == 5

    assert tm.registry.blocks == {}
    assert tm.registry.used(HOST) == 0 and tm.registry.used(DISK) == 0
    assert tm.match(keys(1, 2, 3, 4), count_hit=False).num_matched == 0
    # Settling the old plans afterwards is harmless.
    tm.complete(pending, True)
    tm.complete(load, True)
    assert tm.registry.blocks == {}
    verify_plan(store(tm, 1, 2), ExpectedPlan(keys=[1, 2], tiers=[HOST, HOST]))



# --------------------------------------------------------------------------- promotion
def _on_disk_only(tm: PlacementPolicy, *ids: int) -> None:
    """Blocks ``ids`` end up with a ready G3 copy and no G2 copy (filter disabled)."""
    store(tm, *ids)
    for j in range(100, 100 + tm.capacities[HOST]):
        store(tm, j)  # G2 pressure demotes every earlier block
    for i in ids:
        assert copies(tm, i) == {DISK: True}


def test_promotion_copies_a_disk_hit_back_to_host() -> None:
    tm = make_manager(host=2, disk=8, filter_enabled=False)
    _on_disk_only(tm, 1, 2)
    plan = tm.prepare_promotion(next_job(), keys(1, 2))
    assert plan.kind is PlanKind.PROMOTE and [p.key for p in plan.promotions] == keys(1, 2)
    assert copies(tm, 1) == {DISK: True, HOST: False}  # G2 copy pending, not matchable from G2
    assert tm.match(keys(1), count_hit=False).tiers == (DISK,)
    # While promoting, the G3 copy is being read and cannot be evicted.
    assert all(tm.registry.get(k).busy_job == plan.job_id for k in keys(1, 2))
    outcome = tm.complete(plan, True)
    assert outcome.promoted == 2
    assert copies(tm, 1) == {DISK: True, HOST: True}
    assert tm.match(keys(1, 2), count_hit=False).tiers == (HOST, HOST)
    assert tm.registry.get(key(1)).busy_job is None


def test_failed_promotion_rolls_back_the_host_copy() -> None:
    tm = make_manager(host=2, disk=8, filter_enabled=False)
    _on_disk_only(tm, 1)
    plan = tm.prepare_promotion(next_job(), keys(1))
    assert tm.complete(plan, False).promoted == 0
    assert copies(tm, 1) == {DISK: True}
    # The G2 slot it took (by evicting a filler block, demoted in the same plan) is free again;
    # the rolled-back demotion left that filler nowhere, which is an eviction, not an error.
    assert tm.registry.pools[HOST].allocator.num_used == 1


@pytest.mark.parametrize("why", ["host-copy", "unknown", "no-host-tier"])
def test_promotion_skips_what_it_cannot_or_need_not_do(why: str) -> None:
    if why == "no-host-tier":
        tm = make_manager(disk=4)
        store(tm, 1)
    else:
        tm = make_manager(host=4, disk=4)
        store(tm, 1)
    plan = tm.prepare_promotion(next_job(), keys(1 if why != "unknown" else 9))
    assert plan.is_empty
