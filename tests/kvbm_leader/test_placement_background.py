"""PlacementPolicy: background demotion (G2 -> G3 outside stores), reset and promotion
(G3 -> G2) of the two-phase placement protocol."""
from __future__ import annotations

import pytest

from kvbm_client.ids import PlanKind
from kvbm_leader.placement import PlacementPolicy

from placement_support import (DISK, HOST, ExpectedPlan, copies, key, keys, lru_order, make_demotable,
                               make_frequent, make_manager, make_two_tier_state,
                               next_job, store, verify_plan)


# --------------------------------------------------------------------------- background demotion


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
