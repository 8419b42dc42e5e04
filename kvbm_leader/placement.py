"""Tier placement: the two-phase protocol that decides where blocks go.

Runs in the leader; pure and synchronous (no I/O, no clock): the leader's shell turns these
decisions into signed plans, sends them and reports the outcome back.

Protocol (every long operation is also a *stepper*, see :mod:`.steps`, so the shell can
split a 65536-key request into slices and let other requests in between; each slice's
decisions are atomic):

    prepare_store(job, keys) -> JobPlacement      reserve target slots (pending copies); may
                                                  evict LRU blocks and demote the frequent
                                                  ones G2 -> G3 first (at most
                                                  ``store_demotion_limit`` per store)
    prepare_load(job, keys)  -> JobPlacement      pin the longest ready prefix
    prepare_demotion(job, n) -> JobPlacement      background G2 -> G3 for the watermark
    prepare_promotion(job, keys) -> JobPlacement  G3 -> G2 for blocks just hit on disk
    complete(job, success)   -> Outcome           commit (pending -> ready / unpin) or roll back
    condemn_slots(job, bad)  -> int               copies a worker found bad: never matched again

Invariants: only ready copies are matchable; a pinned block or a copy being read by a
demotion is never evicted; a prepare that cannot be satisfied changes nothing for that block;
a block that needs a slot evicts at most one block (a client never evicts more than it stores);
a store carries at most ``store_demotion_limit`` demotions (the worker writes them to G3 before
it writes the store's blocks into their slots, so the engine's blocks wait for the disk): past
it, the blocks a store evicts are dropped (``skipped_demotions``) and only the background
demotion feeds G3, so a disk slower than the offload stream never holds the engine back.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from kvbm_client.contract import MatchResult
from kvbm_client.ids import BlockHash, JobId, PlanKind, SlotId, Tier

from .decisions import HostDiskMove, JobPlacement, Outcome
from .policies.frequency import FrequencyFilter
from .registry import BlockRegistry
from .registry_types import DiskJournal
from .steps import CompletionStepper, LoadStepper, MatchStepper, StoreStepper

__all__ = ["HostDiskMove", "JobPlacement", "Outcome", "PlacementPolicy", "store_demotion_limit"]


def store_demotion_limit(budget_mb: float, block_bytes: int) -> int | None:
    """Demotions per store for a budget of ``budget_mb`` MB (1e6 bytes) of G2 -> G3 copies:
    None (no limit) for a negative budget or an unknown block size."""
    if budget_mb < 0 or block_bytes <= 0:
        return None
    return int(budget_mb * 1e6 // block_bytes)


class PlacementPolicy:
    """Owns the :class:`BlockRegistry` and applies LRU + the disk offload filter.

    ``generation`` counts resets: a stepper started before a reset must not go on.
    ``journal``: where every registry reports its G3 changes (``DYN_KVBM_DISK_PERSIST``).
    ``store_demotion_limit``: the most G2 -> G3 copies one store may carry (None, the default:
    no limit; the leader sets it from ``DYN_KVBM_STORE_DEMOTION_MB`` at each pool plan, see
    :func:`store_demotion_limit`).
    """

    def __init__(self, capacities: dict[Tier, int], frequency: FrequencyFilter,
                 journal: DiskJournal | None = None) -> None:
        self.capacities = {t: n for t, n in capacities.items() if n > 0}
        self.frequency = frequency
        self.journal = journal
        self.store_demotion_limit: int | None = None
        self.registry = BlockRegistry(self.capacities, journal)
        self.generation = 0

    # ------------------------------------------------------------------ queries
    @property
    def store_tier(self) -> Tier | None:
        """Where offloads from G1 go: G2, or G3 in the disk-only mode."""
        for tier in (Tier.HOST, Tier.DISK):
            if tier in self.registry.pools:
                return tier
        return None

    def capacity(self, tier: Tier) -> int:
        return self.capacities.get(tier, 0)

    def slots_needed(self, keys: Sequence[BlockHash]) -> int:
        """How many slots of the store tier a store of ``keys`` would take (distinct keys
        without a copy there yet)."""
        tier = self.store_tier
        if tier is None:
            return 0
        pool = self.registry.pools[tier]
        return sum(1 for k in set(keys) if k not in pool.ready and k not in pool.unready)

    def usage(self) -> dict[Tier, tuple[int, int, int]]:
        """Per tier: (capacity, used, pinned) blocks; O(1) (the metrics thread reads it)."""
        return {t: (p.capacity, p.allocator.num_used, p.pinned) for t, p in self.registry.pools.items()}

    def match(self, keys: Sequence[BlockHash], count_hit: bool) -> MatchResult:
        return MatchStepper(self, keys, count_hit).run()

    # ------------------------------------------------------------------ eviction
    def _needs_demotion(self, key: BlockHash) -> bool:
        disk = self.registry.pools.get(Tier.DISK)
        return (disk is not None and key not in disk.ready and key not in disk.unready
                and self.frequency.passes(key))

    def _may_demote(self, plan: JobPlacement) -> bool:
        """Whether ``plan`` may carry one more demotion (a store's are bounded; counts a refusal)."""
        limit = self.store_demotion_limit
        if plan.kind is not PlanKind.STORE or limit is None or len(plan.demotions) < limit:
            return True
        plan.skipped_demotions += 1
        return False

    def take_slot(self, tier: Tier, plan: JobPlacement) -> SlotId | None:
        """A slot of ``tier`` for a new copy: free, else evict the LRU evictable block
        (demoting it G2 -> G3 first when the filter says it is worth keeping)."""
        reg = self.registry
        pool = reg.pools[tier]
        slot = pool.allocator.allocate()
        if slot is not None:
            return slot
        victim_key = pool.lru.pop_victim()
        if victim_key is None:
            return None
        if tier is Tier.HOST and self._needs_demotion(victim_key):
            disk_slot = self.take_slot(Tier.DISK, plan) if self._may_demote(plan) else None
            if disk_slot is not None:
                # The worker copies G2 -> G3 before it writes the new block into this slot
                # (same plan, same worker, in order), so the slot can be handed on now.
                reg.add_copy_key(victim_key, None, Tier.DISK, disk_slot, plan.job_id)
                host_slot = reg.take_copy_key(victim_key, Tier.HOST)
                plan.demotions.append(HostDiskMove(victim_key, host_slot, disk_slot))
                return host_slot
        if not any(victim_key in p.ready for t, p in reg.pools.items() if t is not tier):
            plan.dropped += 1  # evicted without a copy elsewhere
        return reg.take_copy_key(victim_key, tier)

    # ------------------------------------------------------------------ prepare
    def prepare_store(self, job_id: JobId, keys: Sequence[BlockHash],
                      parents: Sequence[BlockHash | None] | None = None) -> JobPlacement:
        return StoreStepper(self, job_id, keys, parents).run()

    def prepare_load(self, job_id: JobId, keys: Sequence[BlockHash]) -> JobPlacement:
        return LoadStepper(self, job_id, keys).run()

    def prepare_demotion(self, job_id: JobId, free_target: int, scan_limit: int = 4096) -> JobPlacement:
        """Free G2 slots up to ``free_target`` in the background: blocks that pass the filter
        are copied to G3 first (their G2 slot is freed on commit), the others are dropped now.
        Looks at most ``scan_limit`` LRU blocks (each a pop: no block is looked at twice)."""
        plan = JobPlacement(job_id, PlanKind.DEMOTE)
        reg = self.registry
        pool = reg.pools.get(Tier.HOST)
        if pool is None:
            return plan
        need = min(free_target - pool.allocator.num_free, scan_limit)
        while need > 0:
            key = pool.lru.pop_victim()
            if key is None:
                break
            need -= 1
            entry = reg.blocks[key]
            if self._needs_demotion(key):
                disk_slot = self.take_slot(Tier.DISK, plan)
                if disk_slot is not None:
                    reg.add_copy(entry, Tier.DISK, disk_slot, job_id)
                    reg.set_busy(entry, job_id)  # its G2 copy is read until the job settles
                    plan.demotions.append(HostDiskMove(key, pool.ready[key], disk_slot))
                    continue
            if not entry.ready_in(Tier.DISK):
                plan.dropped += 1
            reg.drop_copy(entry, Tier.HOST)
        return plan

    def prepare_promotion(self, job_id: JobId, keys: Sequence[BlockHash]) -> JobPlacement:
        """Copy blocks that were just hit on G3 back into G2, so their next hit is fast. The G3
        copy stays (it is read, and stays valid); the new G2 copy is pending until commit.
        Nothing changes for a block that has no room in G2."""
        plan = JobPlacement(job_id, PlanKind.PROMOTE)
        reg = self.registry
        if Tier.HOST not in reg.pools:
            return plan
        for key in keys:
            entry = reg.get(key)
            if (entry is None or not entry.ready_in(Tier.DISK) or reg.has_copy(key, Tier.HOST)
                    or entry.busy_job is not None):
                continue
            reg.set_busy(entry, job_id)  # its G3 copy is read: not evictable until settled
            host_slot = self.take_slot(Tier.HOST, plan)
            if host_slot is None:
                reg.set_busy(entry, None)
                break
            reg.add_copy(entry, Tier.HOST, host_slot, job_id)
            plan.promotions.append(HostDiskMove(key, host_slot, reg.pools[Tier.DISK].ready[key]))
        return plan

    # ------------------------------------------------------------------ complete
    def complete(self, plan: JobPlacement, success: bool) -> Outcome:
        return CompletionStepper(self, plan, success).run()

    def condemn_slots(self, plan: JobPlacement, bad: Iterable[tuple[Tier, SlotId]]) -> int:
        """Copies that a worker reported bad while running ``plan`` (checksum mismatch, short
        read): never matched again. A bad *source* of a demotion or promotion also condemns the
        copy written from it. Only copies this job reads or writes are touched; returns how
        many were condemned."""
        bad_set = set(bad)
        if not bad_set:
            return 0
        reg, condemned = self.registry, 0
        moves = {m.key: m for m in (*plan.demotions, *plan.promotions)}
        for key, tier, slot in plan.references():
            if (tier, slot) not in bad_set:
                continue
            entry = reg.get(key)
            if entry is None:
                continue
            targets = [tier]
            move = moves.get(key)
            if move is not None:  # the copy written from a bad source is bad too
                targets.append(Tier.DISK if tier is Tier.HOST else Tier.HOST)
            for t in targets:
                copy = entry.copies.get(t)
                if copy is None or (t is tier and copy.slot != slot):
                    continue
                if t is not tier and copy.job != plan.job_id:
                    continue  # only a copy this job writes follows its source
                condemned += reg.condemn(entry, t)
        return condemned

    def reset(self) -> int:
        """Forget every block (a worker's pools were lost); returns how many were dropped."""
        dropped = len(self.registry.parents)
        self.registry = BlockRegistry(self.capacities, self.journal)
        self.generation += 1
        return dropped

    def resize(self, capacities: dict[Tier, int]) -> int:
        """A new pool plan: new capacities, every block forgotten; returns how many were dropped."""
        self.capacities = {t: n for t, n in capacities.items() if n > 0}
        return self.reset()
