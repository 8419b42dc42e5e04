"""The leader's per-block state holds no object Python's cyclic collector tracks: a full
collection's pause does not grow with the number of blocks by their objects (it was three per
block, a ``BlockEntry``, its ``copies`` dict and a ``TierCopy``; ``benchmarks/gc_pause.py``)."""
from __future__ import annotations

import gc
import itertools

from kvbm_client.ids import BlockHash, JobId, Tier
from kvbm_leader.decisions import JobPlacement
from kvbm_leader.placement import PlacementPolicy
from kvbm_leader.policies.frequency import FrequencyFilter

HOST, DISK = Tier.HOST, Tier.DISK
_ids = iter(range(1, 1 << 30))


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def job() -> JobId:
    return JobId(next(_ids))


def fill(policy: PlacementPolicy, blocks: int) -> list[JobPlacement]:
    """``blocks`` blocks stored in chains of 256 (each with its parent), a quarter of them hit
    (so G2's evictions demote them to G3), then plans left in flight: a load pinning blocks on
    both tiers, a pending store, a background demotion, a promotion and a condemned copy."""
    for start in range(0, blocks, 256):
        keys = [key(i) for i in range(start, start + 256)]
        plan = policy.prepare_store(job(), keys, [None, *keys[:-1]])
        policy.complete(plan, True)
        assert policy.match(keys[:64], count_hit=True).num_matched == 64
    reg = policy.registry
    disk_only = [k for k, e in reg.blocks.items() if HOST not in e.copies]
    host_only = [k for k, e in reg.blocks.items() if DISK not in e.copies]
    policy.frequency.hit_many(list(itertools.islice(reg.pools[HOST].lru.candidates(), 200)))  # worth demoting
    in_flight = [policy.prepare_load(job(), host_only[-100:]), policy.prepare_load(job(), disk_only[:100]),
                 policy.prepare_demotion(job(), 64), policy.prepare_promotion(job(), disk_only[100:150]),
                 policy.prepare_store(job(), [key(blocks + i) for i in range(100)])]
    bad = in_flight[-1]
    assert policy.condemn_slots(bad, [(bad.tiers[0], bad.slots[0])]) >= 1
    assert all(p.keys or p.demotions or p.promotions for p in in_flight), "every kind of plan holds blocks"
    return in_flight


def tracked_growth(blocks: int) -> tuple[int, PlacementPolicy, list[JobPlacement]]:
    """Objects the collector tracks after a policy was filled with ``blocks`` blocks, less before."""
    gc.collect()
    before = len(gc.get_objects())
    policy = PlacementPolicy({HOST: blocks // 2, DISK: blocks}, FrequencyFilter(max_entries=2 * blocks))
    in_flight = fill(policy, blocks)
    gc.collect()  # what a collection that saw them stops tracking (tuples of atomic values)
    return len(gc.get_objects()) - before, policy, in_flight


def test_a_filled_registry_holds_no_tracked_object_per_block() -> None:
    tracked_growth(4096)  # NOTE: what the first use in this process creates once (caches, lazy imports)
    growth, policy, in_flight = tracked_growth(4096)
    reg = policy.registry
    assert len(reg.blocks) > 2500 and reg.used(HOST) == 2048 and reg.used(DISK) > 500
    # The policy's own objects and the plans in flight (a few lists each, and a HostDiskMove per
    # demotion or promotion it carries), none per block: the old layout (three per block) grew
    # by more than 7500. (The margin covers what else the test process makes meanwhile: once,
    # under CI's two workers, 343 against 64 + 264 moves.)
    moves = sum(len(p.demotions) + len(p.promotions) for p in in_flight)
    assert growth <= 256 + moves, (growth, moves)
    again, _, in_flight = tracked_growth(16384)
    # 12288 more blocks: the old layout grew by 36864 more objects. The margin is the test
    # process's own noise (CI's two workers: once 108 against 82 + 8)
    assert again - sum(len(p.demotions) + len(p.promotions) for p in in_flight) <= growth - moves + 256


def test_the_per_block_dicts_are_not_tracked() -> None:
    """Their keys and values are all atomic (bytes, ints, bools, None, tuples of those), pinned,
    busy, pending and corrupt copies included; only the LRUs' and the filter's OrderedDicts are
    tracked (one object each, whatever they hold)."""
    _, policy, _ = tracked_growth(4096)
    reg = policy.registry
    assert reg.pins and reg.busy and all(p.unready for p in reg.pools.values())
    assert any(unready[2] for p in reg.pools.values() for unready in p.unready.values()), "a condemned copy"
    per_block = [reg.parents, reg.pins, reg.busy,
                 *(d for p in reg.pools.values() for d in (p.ready, p.unready, p.owners))]
    assert [gc.is_tracked(d) for d in per_block] == [False] * len(per_block)
