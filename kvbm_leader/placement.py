"""Tier placement: the two-phase protocol that decides where blocks go.

Runs in the leader; pure and synchronous (no I/O, no clock): the daemon shell turns these
decisions into signed plans, sends them and reports the outcome back.

Protocol:
    prepare_store(job, keys) -> StoreDecision   reserve target slots (pending copies);
                                                 may evict LRU blocks and demote the
                                                 frequent ones G2 -> G3 first
    prepare_load(job, keys)  -> LoadDecision    pin the longest ready prefix
    prepare_demotion(job, n) -> LoadDecision    background G2 -> G3 for the watermark
    prepare_promotion(job, keys) -> JobPlan     G3 -> G2 for blocks just hit on disk
    complete(job, success)   -> Outcome          commit (pending -> ready / unpin) or roll back

Invariants: only ready copies are matchable; a pinned block or a copy being read by a
demotion is never evicted; a prepare that cannot be satisfied changes nothing for that block.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvbm_client.contract import MatchResult
from kvbm_client.ids import BlockHash, JobId, PlanKind, SlotId, Tier

from .policies.frequency import FrequencyFilter
from .registry import BlockEntry, BlockRegistry


@dataclass(frozen=True, slots=True)
class Demotion:
    key: BlockHash
    host_slot: SlotId
    disk_slot: SlotId


@dataclass(slots=True)
class JobPlan:
    """The placement part of a job: what each entry reads or writes."""

    job_id: JobId
    kind: PlanKind
    keys: list[BlockHash] = field(default_factory=list)
    tiers: list[Tier] = field(default_factory=list)
    slots: list[SlotId] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)  # STORE: index into the request
    demotions: list[Demotion] = field(default_factory=list)
    promotions: list[Demotion] = field(default_factory=list)  # (key, host slot <- disk slot)
    skipped_present: int = 0
    skipped_full: int = 0
    dropped: int = 0  # evicted without a copy elsewhere

    @property
    def is_empty(self) -> bool:
        return not self.keys and not self.demotions and not self.promotions


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a completed job did, for metrics (Dynamo's names in comments)."""

    stored: dict[Tier, int]  # HOST: offload_blocks_d2h, DISK: offload_blocks_d2d
    demoted: int  # offload_blocks_h2d (host -> disk)
    loaded: dict[Tier, int]  # HOST: onboard_blocks_h2d, DISK: onboard_blocks_d2d
    promoted: int = 0  # disk -> host


class TierManager:
    """Owns the :class:`BlockRegistry` and applies LRU + the disk offload filter."""

    def __init__(self, capacities: dict[Tier, int], frequency: FrequencyFilter) -> None:
        self.capacities = {t: n for t, n in capacities.items() if n > 0}
        self.frequency = frequency
        self.registry = BlockRegistry(self.capacities)

    # ------------------------------------------------------------------ queries
    @property
    def store_tier(self) -> Tier | None:
        """Where offloads from G1 go: G2, or G3 in the disk-only mode."""
        for tier in (Tier.HOST, Tier.DISK):
            if tier in self.registry.pools:
                return tier
        return None

    def match(self, keys: list[BlockHash], count_hit: bool) -> MatchResult:
        tiers: list[Tier] = []
        for key in keys:
            entry = self.registry.get(key)
            tier = entry.best_tier if entry else None
            if tier is None:
                break
            tiers.append(tier)
            if count_hit:
                self.frequency.hit(key)
                self.registry.pools[tier].lru.touch(key)
        return MatchResult(len(tiers), tuple(tiers))

    # ------------------------------------------------------------------ eviction
    def _evictable(self, tier: Tier):
        def check(key: BlockHash) -> bool:
            entry = self.registry.blocks[key]
            return entry.pins == 0 and entry.busy_job is None and entry.ready_in(tier)
        return check

    def _needs_demotion(self, entry: BlockEntry) -> bool:
        return (Tier.DISK in self.registry.pools and Tier.DISK not in entry.copies
                and self.frequency.passes(entry.key))

    def _detach(self, entry: BlockEntry, tier: Tier) -> SlotId:
        """Take a copy away from its block without freeing the slot (the caller reuses it)."""
        copy = entry.copies.pop(tier)
        self.registry.pools[tier].lru.remove(entry.key)
        if not entry.copies:
            self.registry.forget(entry.key)
        return copy.slot

    def _take_slot(self, tier: Tier, plan: JobPlan) -> SlotId | None:
        """A slot of ``tier`` for a new copy: free, else evict the LRU evictable block
        (demoting it G2 -> G3 first when the filter says it is worth keeping)."""
        pool = self.registry.pools[tier]
        slot = pool.allocator.allocate()
        if slot is not None:
            return slot
        victim_key = pool.lru.pick_victim(self._evictable(tier))
        if victim_key is None:
            return None
        victim = self.registry.blocks[victim_key]
        if tier is Tier.HOST and self._needs_demotion(victim):
            disk_slot = self._take_slot(Tier.DISK, plan)
            if disk_slot is not None:
                # The worker copies G2 -> G3 before it writes the new block into this slot
                # (same plan, same worker, in order), so the slot can be handed on now.
                self.registry.add_copy(victim, Tier.DISK, disk_slot, plan.job_id)
                host_slot = self._detach(victim, Tier.HOST)
                plan.demotions.append(Demotion(victim_key, host_slot, disk_slot))
                return host_slot
        if not any(c.is_ready for t, c in victim.copies.items() if t is not tier):
            plan.dropped += 1  # evicted without a copy elsewhere
        return self._detach(victim, tier)

    # ------------------------------------------------------------------ prepare
    def prepare_store(self, job_id: JobId, keys: list[BlockHash],
                      parents: list[BlockHash | None] | None = None) -> JobPlan:
        plan = JobPlan(job_id, PlanKind.STORE)
        tier = self.store_tier
        seen: set[BlockHash] = set()
        for i, key in enumerate(keys):
            entry = self.registry.get(key)
            if key in seen:
                plan.skipped_present += 1
                continue
            seen.add(key)
            # Dynamo's filter: 1 on first sight, doubled on each later sight. A block offered
            # again (another request computed the same prefix) is a later sight, stored or not.
            if self.frequency.frequency(key) > 0:
                self.frequency.hit(key)
            else:
                self.frequency.observe(key)
            if entry is not None and tier in entry.copies:
                plan.skipped_present += 1
                continue
            slot = self._take_slot(tier, plan) if tier is not None else None
            if slot is None:
                plan.skipped_full += 1
                continue
            parent = parents[i] if parents else None
            self.registry.add_copy(self.registry.entry(key, parent), tier, slot, job_id)
            plan.keys.append(key)
            plan.tiers.append(tier)
            plan.slots.append(slot)
            plan.indices.append(i)
        return plan

    def prepare_load(self, job_id: JobId, keys: list[BlockHash]) -> JobPlan:
        plan = JobPlan(job_id, PlanKind.LOAD)
        blocks, pools = self.registry.blocks, self.registry.pools
        for key in keys:  # the hot path of every request
            entry = blocks.get(key)
            tier = entry.best_tier if entry is not None else None
            if tier is None:
                break
            entry.pins += 1
            pools[tier].lru.touch(key)
            plan.keys.append(key)
            plan.tiers.append(tier)
            plan.slots.append(entry.copies[tier].slot)
        return plan

    def prepare_demotion(self, job_id: JobId, free_target: int, scan_limit: int = 4096) -> JobPlan:
        """Free G2 slots up to ``free_target`` in the background: blocks that pass the filter
        are copied to G3 first (their G2 slot is freed on commit), the others are dropped now."""
        plan = JobPlan(job_id, PlanKind.DEMOTE)
        pool = self.registry.pools.get(Tier.HOST)
        if pool is None:
            return plan
        need = free_target - pool.allocator.num_free
        evictable = self._evictable(Tier.HOST)
        for i, key in enumerate(list(pool.lru.candidates())):
            if need <= 0 or i >= scan_limit:
                break
            if not evictable(key):
                continue
            entry = self.registry.blocks[key]
            if self._needs_demotion(entry):
                disk_slot = self._take_slot(Tier.DISK, plan)
                if disk_slot is not None:
                    self.registry.add_copy(entry, Tier.DISK, disk_slot, job_id)
                    entry.busy_job = job_id
                    plan.demotions.append(Demotion(key, entry.copies[Tier.HOST].slot, disk_slot))
                    need -= 1
                    continue
            if not entry.ready_in(Tier.DISK):
                plan.dropped += 1
            self.registry.drop_copy(entry, Tier.HOST)
            need -= 1
        return plan

    def prepare_promotion(self, job_id: JobId, keys: list[BlockHash]) -> JobPlan:
        """Copy blocks that were just hit on G3 back into G2, so their next hit is fast. The G3
        copy stays (it is read, and stays valid); the new G2 copy is pending until commit.
        Nothing changes for a block that has no room in G2."""
        plan = JobPlan(job_id, PlanKind.PROMOTE)
        if Tier.HOST not in self.registry.pools:
            return plan
        for key in keys:
            entry = self.registry.get(key)
            if (entry is None or not entry.ready_in(Tier.DISK) or Tier.HOST in entry.copies
                    or entry.busy_job is not None):
                continue
            entry.busy_job = job_id  # its G3 copy is read: not evictable until settled
            host_slot = self._take_slot(Tier.HOST, plan)
            if host_slot is None:
                entry.busy_job = None
                break
            self.registry.add_copy(entry, Tier.HOST, host_slot, job_id)
            plan.promotions.append(Demotion(key, host_slot, entry.copies[Tier.DISK].slot))
        return plan

    # ------------------------------------------------------------------ complete
    def _settle_copy(self, key: BlockHash, tier: Tier, job_id: JobId, success: bool) -> bool:
        entry = self.registry.get(key)
        copy = entry.copies.get(tier) if entry else None
        if copy is None or copy.job != job_id:
            return False
        if success:
            copy.job = None
        else:
            self.registry.drop_copy(entry, tier)
        return success

    def complete(self, plan: JobPlan, success: bool) -> Outcome:
        stored = {Tier.HOST: 0, Tier.DISK: 0}
        loaded = {Tier.HOST: 0, Tier.DISK: 0}
        demoted = 0
        for d in plan.demotions:
            demoted += self._settle_copy(d.key, Tier.DISK, plan.job_id, success)
            entry = self.registry.get(d.key)
            if plan.kind is PlanKind.DEMOTE and entry is not None and entry.busy_job == plan.job_id:
                entry.busy_job = None
                # The G2 copy was kept readable while it was copied; now free its slot.
                if success and entry.pins == 0 and entry.ready_in(Tier.HOST):
                    self.registry.drop_copy(entry, Tier.HOST)
        if plan.kind is PlanKind.STORE:
            for key, tier in zip(plan.keys, plan.tiers):
                stored[tier] += self._settle_copy(key, tier, plan.job_id, success)
        elif plan.kind is PlanKind.LOAD:
            for key, tier in zip(plan.keys, plan.tiers):
                entry = self.registry.get(key)
                if entry is not None and entry.pins > 0:
                    entry.pins -= 1
                loaded[tier] += success
        promoted = 0
        for p in plan.promotions:
            promoted += self._settle_copy(p.key, Tier.HOST, plan.job_id, success)
            entry = self.registry.get(p.key)
            if entry is not None and entry.busy_job == plan.job_id:
                entry.busy_job = None
        return Outcome(stored, demoted, loaded, promoted)

    def reset(self) -> int:
        """Forget every block (a worker's pools were lost); returns how many were dropped."""
        dropped = len(self.registry.blocks)
        self.registry = BlockRegistry(self.capacities)
        return dropped
