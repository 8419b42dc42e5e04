"""The registry's batched operations (``load_slots``, ``pin_keys``, ``unpin_keys``: every load's
hot path) leave the state that one key at a time leaves (the model below: the registry's
per-key code before the batches), LRU order included, under random traffic with repeated,
pinned, busy, condemned, pending and G3-only blocks."""
from __future__ import annotations

import random
from typing import Any

from kvbm_client.ids import BlockHash, JobId, Tier
from kvbm_leader.decisions import JobPlacement
from kvbm_leader.placement import PlacementPolicy
from kvbm_leader.policies.frequency import FrequencyFilter
from kvbm_leader.registry import BlockRegistry

HOST, DISK = Tier.HOST, Tier.DISK


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(8, "big"))


def state(reg: BlockRegistry) -> dict[str, Any]:
    """Everything the registry holds, in order where order matters (the LRUs)."""
    return {"parents": dict(reg.parents), "pins": dict(reg.pins), "busy": dict(reg.busy),
            "forgotten": list(reg.forgotten),
            "pools": {t: (dict(p.ready), dict(p.unready), dict(p.owners), p.pinned, p.allocator.num_free,
                          list(p.lru.candidates())) for t, p in reg.pools.items()}}


def one_by_one_pins(reg: BlockRegistry, keys: list[BlockHash]) -> None:
    """The model: each key's pin counted; its first takes its copies out of the LRUs."""
    for k in keys:
        reg.pins[k] = reg.pins.get(k, 0) + 1
        if reg.pins[k] == 1:
            for pool in reg.pools.values():
                if k in pool.ready or k in pool.unready:
                    pool.pinned += 1
                    pool.lru.remove(k)


def one_by_one_unpins(reg: BlockRegistry, keys: list[BlockHash]) -> None:
    """The model: each key's pin dropped; at its last, the key's copies are refreshed."""
    for k in keys:
        pins = reg.pins.get(k, 0)
        if pins == 0:
            continue
        if pins > 1:
            reg.pins[k] = pins - 1
            continue
        del reg.pins[k]
        for pool in reg.pools.values():
            if k in pool.ready or k in pool.unready:
                pool.pinned -= 1
        reg._refresh(k)


def one_by_one_slots(reg: BlockRegistry, keys: list[BlockHash]) -> tuple[list[Tier], list[int]]:
    tiers, slots = [], []
    for k in keys:
        found = reg.load_slot(k)
        if found is None:
            break
        tiers.append(found[0])
        slots.append(found[1])
    return tiers, slots


def traffic(seed: int, steps: int = 1500) -> None:
    rng = random.Random(seed)
    each = PlacementPolicy({HOST: 12, DISK: 20}, FrequencyFilter(1000, enabled=False))
    batch = PlacementPolicy({HOST: 12, DISK: 20}, FrequencyFilter(1000, enabled=False))
    ids = iter(range(1, 1 << 30))
    plans: list[tuple[JobPlacement, JobPlacement]] = []
    pinned: list[list[BlockHash]] = []  # key lists pinned by hand, to unpin later
    seen = {"dup": 0, "busy": 0, "condemned": 0, "disk": 0, "stopped": 0}
    for _ in range(steps):
        op = rng.random()
        if op < 0.2:
            job, ks = JobId(next(ids)), [key(i) for i in rng.sample(range(40), rng.randint(1, 6))]
            plans.append((each.prepare_store(job, ks), batch.prepare_store(job, ks)))
        elif op < 0.3:
            job, n = JobId(next(ids)), rng.randint(0, 6)
            plans.append((each.prepare_demotion(job, n), batch.prepare_demotion(job, n)))
        elif op < 0.35:
            job, ks = JobId(next(ids)), [key(i) for i in rng.sample(range(40), 3)]
            plans.append((each.prepare_promotion(job, ks), batch.prepare_promotion(job, ks)))
        elif op < 0.4 and plans:
            a, b = plans[rng.randrange(len(plans))]
            refs = list(a.references())
            if refs:
                _, tier, slot = rng.choice(refs)
                each.condemn_slots(a, [(tier, slot)])
                batch.condemn_slots(b, [(tier, slot)])
                seen["condemned"] += 1
        elif op < 0.55 and plans:
            a, b = plans.pop(rng.randrange(len(plans)))
            ok = rng.random() < 0.8
            each.complete(a, ok)
            batch.complete(b, ok)
        elif op < 0.8:  # a load's lookup and pins, sometimes with a repeated or missing key
            ks = [key(rng.randrange(44)) for _ in range(rng.randint(1, 12))]
            if rng.random() < 0.3:
                ks.insert(rng.randrange(len(ks) + 1), ks[0])
            found = one_by_one_slots(each.registry, ks)
            assert batch.registry.load_slots(ks) == found
            seen["stopped"] += len(found[1]) < len(ks)
            seen["disk"] += DISK in found[0]
            head = ks[:len(found[1])]
            seen["dup"] += len(set(head)) < len(head)
            seen["busy"] += any(k in each.registry.busy for k in head)
            one_by_one_pins(each.registry, head)
            batch.registry.pin_keys(head)
            pinned.append(head)
        elif pinned:
            head = pinned.pop(rng.randrange(len(pinned)))
            one_by_one_unpins(each.registry, head)
            batch.registry.unpin_keys(head)
        assert state(batch.registry) == state(each.registry)
    for head in pinned:
        one_by_one_unpins(each.registry, head)
        batch.registry.unpin_keys(head)
    assert state(batch.registry) == state(each.registry)
    # the traffic reached every case the batched paths treat apart
    assert all(n > 0 for n in seen.values()), seen


def test_batched_pins_and_lookups_leave_the_per_key_state() -> None:
    for seed in range(6):
        traffic(seed)


def test_a_whole_g2_hit_is_found_in_one_pass_and_a_missing_block_ends_it() -> None:
    reg = BlockRegistry({HOST: 8, DISK: 8})
    for i in range(4):
        reg.add_copy_key(key(i), None, HOST, i, None)  # type: ignore[arg-type]
    reg.add_copy_key(key(4), None, DISK, 0, None)  # type: ignore[arg-type]
    assert reg.load_slots([key(0), key(1), key(2)]) == ([HOST] * 3, [0, 1, 2])
    assert reg.load_slots([key(3), key(4), key(0)]) == ([HOST, DISK, HOST], [3, 0, 0])
    assert reg.load_slots([key(1), key(9), key(2)]) == ([HOST], [1])
    assert reg.load_slots([]) == ([], [])
