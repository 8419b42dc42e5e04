"""PlacementPolicy + BlockRegistry: the two-phase placement protocol (stores, loads, rollback)
and eviction with demotion in the store plan. Background demotion, reset and promotion:
test_placement_background.py."""
from __future__ import annotations

import pytest

from kvbm_client.contract import MatchResult
from kvbm_client.ids import PlanKind, SlotId
from kvbm_leader.placement import JobPlacement, PlacementPolicy, store_demotion_limit

from placement_support import (DISK, HOST, ExpectedPlan, copies, key, keys, lru_order, make_demotable,
                               make_frequent, make_manager, make_two_tier_state,
                               next_job, snapshot, store, verify_plan)


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
