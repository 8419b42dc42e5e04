"""Helpers of the PlacementPolicy tests (test_placement*.py): block keys, stores, snapshots."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvbm_client.ids import BlockHash, JobId, Tier
from kvbm_leader.placement import JobPlacement, PlacementPolicy
from kvbm_leader.policies.frequency import FrequencyFilter

HOST, DISK = Tier.HOST, Tier.DISK


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


def make_demotable(filter_enabled: bool = True) -> PlacementPolicy:
    """G2 (4 slots) full of 1..4 with 1 and 2 frequent; LRU order [3, 4, 1, 2]."""
    tm = make_manager(host=4, disk=4, filter_enabled=filter_enabled)
    store(tm, 1, 2, 3, 4)
    make_frequent(tm, 1, 2)
    assert lru_order(tm, HOST) == [3, 4, 1, 2]
    return tm
