"""BlockRegistry invariants under random placement traffic, evictable-only LRUs, steppers
run in slices, and bad copies of demotions and promotions."""
from __future__ import annotations

import random

import pytest

from kvbm_client.ids import BlockHash, JobId, PlanKind, SlotId, Tier
from kvbm_leader.decisions import JobPlacement
from kvbm_leader.placement import PlacementPolicy
from kvbm_leader.policies.frequency import FrequencyFilter
from kvbm_leader.steps import LoadStepper, MatchStepper, StoreStepper

HOST, DISK = Tier.HOST, Tier.DISK
_ids = iter(range(1, 1 << 30))


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(8, "big"))


def keys(*ids: int) -> list[BlockHash]:
    return [key(i) for i in ids]


def job() -> JobId:
    return JobId(next(_ids))


def make(host: int = 8, disk: int = 8) -> PlacementPolicy:
    return PlacementPolicy({HOST: host, DISK: disk}, FrequencyFilter(1000, enabled=False))


def check_invariants(tm: PlacementPolicy) -> None:
    """The LRUs hold exactly the evictable copies, the owners and pinned counts are exact."""
    reg = tm.registry
    for tier, pool in reg.pools.items():
        evictable = {k for k, e in reg.blocks.items()
                     if tier in e.copies and e.copies[tier].is_ready and e.is_free}
        assert set(pool.lru.candidates()) == evictable, tier
        owners = {e.copies[tier].slot: k for k, e in reg.blocks.items() if tier in e.copies}
        assert pool.owners == owners, tier
        assert pool.pinned == sum(1 for e in reg.blocks.values() if e.pins and tier in e.copies), tier
        assert pool.allocator.num_used == len(owners), tier


def test_invariants_hold_under_random_traffic() -> None:
    rng = random.Random(7)
    tm = make(host=16, disk=24)
    open_plans: list[tuple[JobPlacement, bool]] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.3:
            open_plans.append((tm.prepare_store(job(), keys(*rng.sample(range(60), rng.randint(1, 6)))), True))
        elif op < 0.5:
            open_plans.append((tm.prepare_load(job(), keys(*rng.sample(range(60), rng.randint(1, 4)))), True))
        elif op < 0.6:
            open_plans.append((tm.prepare_demotion(job(), rng.randint(0, 16)), True))
        elif op < 0.65:
            open_plans.append((tm.prepare_promotion(job(), keys(*rng.sample(range(60), 3))), True))
        elif op < 0.7 and open_plans:
            plan, _ = open_plans[rng.randrange(len(open_plans))]
            refs = list(plan.references())
            if refs:
                _, tier, slot = rng.choice(refs)
                tm.condemn_slots(plan, [(tier, slot)])
        elif open_plans:
            plan, _ = open_plans.pop(rng.randrange(len(open_plans)))
            tm.complete(plan, rng.random() < 0.8)
        tm.match(keys(*rng.sample(range(60), 3)), count_hit=rng.random() < 0.5)
        check_invariants(tm)
    for plan, _ in open_plans:
        tm.complete(plan, True)
    check_invariants(tm)
    assert all(e.pins == 0 and e.busy_job is None for e in tm.registry.blocks.values())


def test_a_tier_full_of_pending_copies_has_nothing_to_scan() -> None:
    tm = make(host=1000, disk=0)
    tm.prepare_store(job(), keys(*range(1000)))  # never copied: every slot pending
    assert len(tm.registry.pools[HOST].lru) == 0
    plan = tm.prepare_store(job(), keys(*range(1000, 3000)))
    assert plan.skipped_full == 2000 and plan.is_empty


@pytest.mark.parametrize("slice_items", [1, 3, 7])
def test_a_stepper_in_slices_decides_what_one_pass_decides(slice_items: int) -> None:
    def scenario() -> PlacementPolicy:
        tm = make(host=6, disk=6)
        tm.complete(tm.prepare_store(job(), keys(1, 2, 3, 4)), True)
        return tm

    request = keys(5, 1, 6, 6, 7, 8, 9, 10)
    whole, sliced = scenario(), scenario()
    expected = StoreStepper(whole, JobId(1), request).run()
    stepper = StoreStepper(sliced, JobId(1), request)
    while not stepper.step(slice_items):
        pass
    assert stepper.plan == expected
    check_invariants(sliced)
    load_whole = LoadStepper(whole, JobId(2), keys(1, 2, 3, 9)).run()
    load = LoadStepper(sliced, JobId(2), keys(1, 2, 3, 9))
    while not load.step(slice_items):
        pass
    assert load.plan == load_whole
    match = MatchStepper(sliced, keys(1, 2, 3), count_hit=False)
    while not match.step(slice_items):
        pass
    assert match.result == whole.match(keys(1, 2, 3), count_hit=False)


def test_slots_needed_counts_distinct_new_keys() -> None:
    tm = make(host=4)
    tm.complete(tm.prepare_store(job(), keys(1, 2)), True)
    assert tm.slots_needed(keys(1, 2, 3, 3, 4)) == 2
    assert make(host=0, disk=0).slots_needed(keys(1)) == 0


def test_a_bad_demotion_source_drops_both_copies_and_the_slots_come_back() -> None:
    tm = make(host=2, disk=4)
    tm.complete(tm.prepare_store(job(), keys(1, 2)), True)
    plan = tm.prepare_demotion(job(), free_target=2)
    assert [m.key for m in plan.demotions] == keys(1, 2)
    move = plan.demotions[0]
    assert tm.condemn_slots(plan, [(HOST, move.host_slot)]) == 2
    assert tm.match(keys(1), count_hit=False).num_matched == 0
    tm.complete(plan, True)
    assert tm.registry.get(key(1)) is None
    assert tm.match(keys(2), count_hit=False).tiers == (DISK,)
    assert tm.registry.pools[HOST].allocator.num_free == 2 and tm.registry.used(DISK) == 1
    check_invariants(tm)


def test_a_bad_promotion_source_drops_the_disk_copy_and_the_pending_host_copy() -> None:
    tm = make(host=1, disk=4)
    tm.complete(tm.prepare_store(job(), keys(1)), True)
    tm.complete(tm.prepare_store(job(), keys(2)), True)  # 1 demoted to G3
    tm.complete(tm.prepare_store(job(), keys(3)), True)  # 2 demoted to G3
    plan = tm.prepare_promotion(job(), keys(1))
    assert len(plan.promotions) == 1
    disk_slot = plan.promotions[0].disk_slot
    assert tm.condemn_slots(plan, [(DISK, disk_slot)]) == 2
    tm.complete(plan, False)
    assert tm.registry.get(key(1)) is None
    assert tm.registry.owner(DISK, disk_slot) is None
    check_invariants(tm)


def test_a_bad_slot_of_another_tier_or_job_changes_nothing() -> None:
    tm = make(host=4)
    tm.complete(tm.prepare_store(job(), keys(1)), True)
    load = tm.prepare_load(job(), keys(1))
    stranger = JobPlacement(job(), PlanKind.LOAD, keys=keys(1), tiers=[HOST], slots=[SlotId(3)])
    assert tm.condemn_slots(stranger, [(HOST, SlotId(3))]) == 0
    assert tm.condemn_slots(load, [(DISK, load.slots[0])]) == 0
    tm.complete(load, True)
    assert tm.match(keys(1), count_hit=False).num_matched == 1
