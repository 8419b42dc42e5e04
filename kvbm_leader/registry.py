"""Block registry: which sequence hash lives in which tier and slot, and in what state.

Runs in the leader; pure and synchronous. A block may have one copy per tier (G2, G3).
A copy is *pending* from the moment its slot is reserved until every worker confirmed the
bytes landed; only *ready* copies are matchable. ``pins`` counts loads in flight reading the
block; a pinned block is never evicted, in any tier.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvbm_client.ids import BlockHash, JobId, SlotId, Tier

from .allocator import SlotAllocator
from .policies.lru import LRUPolicy


@dataclass(slots=True)
class TierCopy:
    """One copy of a block in one tier."""

    slot: SlotId
    job: JobId | None  # the store/demote job writing it; None once ready

    @property
    def is_ready(self) -> bool:
        return self.job is None


_LOAD_ORDER = (Tier.HOST, Tier.DISK)


@dataclass(slots=True)
class BlockEntry:
    """Everything the leader knows about one logical block (all ranks' shards together)."""

    key: BlockHash
    parent: BlockHash | None = None
    copies: dict[Tier, TierCopy] = field(default_factory=dict)
    pins: int = 0  # loads in flight
    busy_job: JobId | None = None  # a demotion reading this block's G2 copy

    def ready_in(self, tier: Tier) -> bool:
        copy = self.copies.get(tier)
        return copy is not None and copy.is_ready

    @property
    def is_matchable(self) -> bool:
        return any(c.is_ready for c in self.copies.values())

    @property
    def best_tier(self) -> Tier | None:
        """The fastest tier holding a ready copy (every load asks this per block: kept to dict lookups)."""
        copies = self.copies
        for tier in _LOAD_ORDER:
            copy = copies.get(tier)
            if copy is not None and copy.job is None:
                return tier
        return None


@dataclass
class TierPool:
    """Capacity, free slots and LRU order of one tier."""

    tier: Tier
    allocator: SlotAllocator
    lru: LRUPolicy = field(default_factory=LRUPolicy)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity


class BlockRegistry:
    """Hash -> :class:`BlockEntry`, plus one :class:`TierPool` per configured tier."""

    def __init__(self, capacities: dict[Tier, int]) -> None:
        self.blocks: dict[BlockHash, BlockEntry] = {}
        self.forgotten: list[BlockHash] = []  # blocks gone since the last take_forgotten()
        self.pools: dict[Tier, TierPool] = {
            tier: TierPool(tier, SlotAllocator(n)) for tier, n in capacities.items() if n > 0}

    def get(self, key: BlockHash) -> BlockEntry | None:
        return self.blocks.get(key)

    def entry(self, key: BlockHash, parent: BlockHash | None = None) -> BlockEntry:
        found = self.blocks.get(key)
        if found is None:
            found = self.blocks[key] = BlockEntry(key, parent)
        return found

    def add_copy(self, entry: BlockEntry, tier: Tier, slot: SlotId, job: JobId | None) -> None:
        assert tier not in entry.copies, f"{entry.key.hex()} already has a {tier.label} copy"
        entry.copies[tier] = TierCopy(slot, job)
        self.pools[tier].lru.insert(entry.key)

    def drop_copy(self, entry: BlockEntry, tier: Tier) -> SlotId:
        """Remove the copy, free its slot, forget the block when no copy remains."""
        copy = entry.copies.pop(tier)
        pool = self.pools[tier]
        pool.lru.remove(entry.key)
        pool.allocator.free(copy.slot)
        if not entry.copies:
            self.forget(entry.key)
        return copy.slot

    def forget(self, key: BlockHash) -> None:
        """Drop a block that has no copy left (journaled for the KV events)."""
        if self.blocks.pop(key, None) is not None:
            self.forgotten.append(key)

    def take_forgotten(self) -> list[BlockHash]:
        out, self.forgotten = self.forgotten, []
        return out

    def used(self, tier: Tier) -> int:
        pool = self.pools.get(tier)
        return pool.allocator.num_used if pool else 0

    def count_pinned(self, tier: Tier) -> int:
        return sum(1 for e in self.blocks.values() if e.pins and tier in e.copies)
