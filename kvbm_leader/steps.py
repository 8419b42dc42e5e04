"""Steppers: the long placement operations, resumable a slice of keys at a time.

Runs in the leader; pure and synchronous. A request of up to ``DYN_KVBM_MAX_HASHES_PER_REQUEST``
keys costs a few microseconds per key, so one pass could hold the leader's event loop for
hundreds of milliseconds. Each stepper does the work of :class:`~.placement.PlacementPolicy`'s
one-shot method in order, ``step(n)`` handling the next ``n`` items; the shell
(:mod:`.slicing`) yields to the loop between steps. Between two steps other requests may run:
each step's decisions are atomic, and a later step sees their effects (a block evicted by
someone else ends a load's prefix; a block stored by someone else is skipped as present).
A stepper must not go on after :meth:`~.placement.PlacementPolicy.reset`
(``PlacementPolicy.generation`` changed): its state belongs to the old registry.

Protocol: ``step(n) -> bool`` (True once done), ``run()`` (all at once), ``result``.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Protocol, Sequence

from kvbm_client.contract import MatchResult
from kvbm_client.ids import BlockHash, JobId, PlanKind, Tier

from .decisions import JobPlacement, Outcome

if TYPE_CHECKING:
    from .placement import PlacementPolicy


class Stepper(Protocol):
    def step(self, budget: int) -> bool:
        """Handle up to ``budget`` more items; True when nothing is left."""


class _Cursor:
    """Position over ``total`` items; ``step`` calls ``_do(start, stop)``."""

    total = 0
    position = 0
    finished = False

    def _do(self, start: int, stop: int) -> bool:
        """Handle items ``start:stop``; False ends the operation early."""
        raise NotImplementedError

    def step(self, budget: int) -> bool:
        if not self.finished:
            stop = min(self.total, self.position + max(1, budget))
            go_on = self._do(self.position, stop)
            self.position = stop
            self.finished = not go_on or stop >= self.total
        return self.finished


class StoreStepper(_Cursor):
    """``prepare_store``: a pending copy in the store tier for each new key, in request order."""

    def __init__(self, policy: "PlacementPolicy", job_id: JobId, keys: Sequence[BlockHash],
                 parents: Sequence[BlockHash | None] | None = None) -> None:
        self.policy, self.keys, self.parents = policy, keys, parents
        self.plan = JobPlacement(job_id, PlanKind.STORE)
        self.total = len(keys)
        self._seen: set[BlockHash] = set()

    def _do(self, start: int, stop: int) -> bool:
        policy, plan, seen, keys, parents = self.policy, self.plan, self._seen, self.keys, self.parents
        reg, freq, tier = policy.registry, policy.frequency, policy.store_tier
        pool = reg.pools[tier] if tier is not None else None
        for i in range(start, stop):
            key = keys[i]
            if key in seen:
                plan.skipped_present += 1
                continue
            seen.add(key)
            # Dynamo's filter: 1 on first sight, doubled on each later sight. A block offered
            # again (another request computed the same prefix) is a later sight, stored or not.
            freq.offer(key)
            if pool is not None and (key in pool.ready or key in pool.unready):
                plan.skipped_present += 1
                continue
            slot = policy.take_slot(tier, plan) if tier is not None else None
            if slot is None:
                plan.skipped_full += 1
                continue
            assert tier is not None
            reg.add_copy_key(key, parents[i] if parents else None, tier, slot, plan.job_id)
            plan.keys.append(key)
            plan.tiers.append(tier)
            plan.slots.append(slot)
            plan.indices.append(i)
        return True

    def run(self) -> JobPlacement:
        self.step(self.total)
        return self.plan


class LoadStepper(_Cursor):
    """``prepare_load``: pin the longest ready prefix (the hot path of every request)."""

    def __init__(self, policy: "PlacementPolicy", job_id: JobId, keys: Sequence[BlockHash]) -> None:
        self.policy, self.keys = policy, keys
        self.plan = JobPlacement(job_id, PlanKind.LOAD)
        self.total = len(keys)

    def _do(self, start: int, stop: int) -> bool:
        reg, plan = self.policy.registry, self.plan
        tiers, slots = reg.load_slots(self.keys[start:stop])
        keys = self.keys[start:start + len(slots)]
        reg.pin_keys(keys)  # out of the LRUs until unpinned: a use, they come back most recent
        plan.keys.extend(keys)
        plan.tiers.extend(tiers)
        plan.slots.extend(slots)
        return len(slots) == stop - start

    def run(self) -> JobPlacement:
        self.step(self.total)
        return self.plan


class HitStepper(_Cursor):
    """A load's hit (``count_hit``): each key's frequency doubled (the disk offload filter's)."""

    def __init__(self, policy: "PlacementPolicy", keys: Sequence[BlockHash]) -> None:
        self.policy, self.keys = policy, keys
        self.total = len(keys)

    def _do(self, start: int, stop: int) -> bool:
        self.policy.frequency.hit_many(self.keys[start:stop])
        return True


class MatchStepper(_Cursor):
    """``match``: the longest ready prefix (``count_hit``: a use of each block, and a hit)."""

    def __init__(self, policy: "PlacementPolicy", keys: Sequence[BlockHash], count_hit: bool) -> None:
        self.policy, self.keys, self.count_hit = policy, keys, count_hit
        self.tiers: list[Tier] = []
        self.total = len(keys)

    def _do(self, start: int, stop: int) -> bool:
        reg, freq, tiers = self.policy.registry, self.policy.frequency, self.tiers
        for i in range(start, stop):
            key = self.keys[i]
            found = reg.load_slot(key)
            if found is None:
                return False
            tier = found[0]
            tiers.append(tier)
            if self.count_hit:
                freq.hit(key)
                reg.pools[tier].lru.touch(key)
        return True

    @property
    def result(self) -> MatchResult:
        return MatchResult(len(self.tiers), tuple(self.tiers))

    def run(self) -> MatchResult:
        self.step(self.total)
        return self.result


class CompletionStepper(_Cursor):
    """``complete``: commit or roll back a job, demotions first, then entries, then promotions.

    NOTE: settling is per copy (a copy is ready only once every worker confirmed it), so a
    half-settled job is a consistent state; a copy not owned by this job is left alone, so
    settling twice, or after a reset, counts nothing and changes nothing.
    """

    def __init__(self, policy: "PlacementPolicy", plan: JobPlacement, success: bool) -> None:
        self.policy, self.plan, self.success = policy, plan, success
        self.outcome = Outcome()
        self._demotions, self._entries = len(plan.demotions), len(plan.keys)
        self.total = self._demotions + self._entries + len(plan.promotions)

    def _settle_copy(self, key: BlockHash, tier: Tier) -> bool:
        return self.policy.registry.settle(key, tier, self.plan.job_id, self.success)

    def _demotion(self, i: int) -> None:
        move, reg, plan = self.plan.demotions[i], self.policy.registry, self.plan
        self.outcome.demoted += self._settle_copy(move.key, Tier.DISK)
        entry = reg.get(move.key)
        if plan.kind is PlanKind.DEMOTE and entry is not None and entry.busy_job == plan.job_id:
            # The G2 copy was kept readable while it was copied; now free its slot.
            if self.success and entry.pins == 0 and entry.ready_in(Tier.HOST):
                reg.drop_copy(entry, Tier.HOST)
            if move.key in reg.parents:  # not forgotten with that copy
                reg.set_busy(entry, None)

    def _entry(self, i: int) -> None:
        plan, out = self.plan, self.outcome
        key, tier = plan.keys[i], plan.tiers[i]
        if plan.kind is PlanKind.STORE:
            if self._settle_copy(key, tier):
                out.stored[tier] += 1
                out.ready.append((key, tier))

    def _promotion(self, i: int) -> None:
        move, reg = self.plan.promotions[i], self.policy.registry
        self.outcome.promoted += self._settle_copy(move.key, Tier.HOST)
        entry = reg.get(move.key)
        if entry is not None and entry.busy_job == self.plan.job_id:
            reg.set_busy(entry, None)

    def _loads(self, start: int, stop: int) -> None:
        """A load's entries ``start:stop`` settled: unpinned together (a load has no demotions
        or promotions, only entries)."""
        plan = self.plan
        self.policy.registry.unpin_keys(plan.keys[start:stop])
        if self.success:
            loaded = self.outcome.loaded
            for tier, n in Counter(plan.tiers[start:stop]).items():
                loaded[tier] += n

    def _do(self, start: int, stop: int) -> bool:
        d, e = self._demotions, self._demotions + self._entries
        if self.plan.kind is PlanKind.LOAD:
            assert d == 0 and e == self.total, "a load plan carries entries only"
            self._loads(start, stop)
            return True
        for i in range(start, stop):
            if i < d:
                self._demotion(i)
            elif i < e:
                self._entry(i - d)
            else:
                self._promotion(i - e)
        return True

    def run(self) -> Outcome:
        self.step(self.total)
        return self.outcome
