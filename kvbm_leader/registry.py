"""Block registry: which sequence hash lives in which tier and slot, and in what state.

Runs in the leader; pure and synchronous. A block may have one copy per tier (G2, G3).
A copy is *pending* from the moment its slot is reserved until every worker confirmed the
bytes landed; only *ready* copies are matchable. ``pins`` counts loads in flight reading the
block; ``busy_job`` names a demotion or promotion reading it. A pinned or busy block is
never evicted, in any tier.

Invariants kept here (every state change goes through a method of :class:`BlockRegistry`):

* a tier's LRU holds exactly the copies that may be evicted now (ready, not corrupt, block
  unpinned and not busy), so a victim is a pop (:mod:`.policies.lru`);
* ``TierPool.owners`` maps every occupied slot to its block, ``TierPool.pinned`` counts the
  pinned blocks with a copy in the tier (``Status`` and the metrics read them in O(1));
* a *corrupt* copy (a worker reported its bytes bad) is never matched again; its slot is
  freed as soon as no load, demotion or live job still uses it;
* with a :class:`DiskJournal` (``DYN_KVBM_DISK_PERSIST``), every G3 copy that becomes ready
  is reported with the job that wrote it, and every G3 copy taken away is reported, in the
  order they happen (a restore adds copies without reporting them: they are indexed already).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvbm_client.ids import BlockHash, JobId, SlotId, Tier

from .allocator import SlotAllocator
from .policies.lru import LRUPolicy


@dataclass(slots=True)
class TierCopy:
    """One copy of a block in one tier."""

    slot: SlotId
    job: JobId | None  # the store/demote/promote job writing it; None once written
    corrupt: bool = False  # its bytes failed verification: never matched, freed when unused

    @property
    def is_ready(self) -> bool:
        return self.job is None and not self.corrupt


_LOAD_ORDER = (Tier.HOST, Tier.DISK)


@dataclass(slots=True)
class BlockEntry:
    """Everything the leader knows about one logical block (all ranks' shards together)."""

    key: BlockHash
    parent: BlockHash | None = None
    copies: dict[Tier, TierCopy] = field(default_factory=dict)
    pins: int = 0  # loads in flight
    busy_job: JobId | None = None  # a demotion (reads G2) or promotion (reads G3) of this block

    def ready_in(self, tier: Tier) -> bool:
        copy = self.copies.get(tier)
        return copy is not None and copy.is_ready

    @property
    def is_free(self) -> bool:
        """Nobody reads the block now: no load pins it, no demotion or promotion copies it."""
        return self.pins == 0 and self.busy_job is None

    @property
    def is_matchable(self) -> bool:
        return any(c.is_ready for c in self.copies.values())

    @property
    def best_tier(self) -> Tier | None:
        """The fastest tier holding a ready copy (every load asks this per block: kept to dict lookups)."""
        copies = self.copies
        for tier in _LOAD_ORDER:
            copy = copies.get(tier)
            if copy is not None and copy.job is None and not copy.corrupt:
                return tier
        return None


@dataclass
class TierPool:
    """Capacity, free slots, slot owners and the LRU order of the evictable copies of one tier."""

    tier: Tier
    allocator: SlotAllocator
    lru: LRUPolicy = field(default_factory=LRUPolicy)
    owners: dict[SlotId, BlockHash] = field(default_factory=dict)
    pinned: int = 0  # pinned blocks with a copy here

    @property
    def capacity(self) -> int:
        return self.allocator.capacity


class DiskJournal(Protocol):
    """Where changes of ready G3 copies go (the leader's persistent G3 index); both calls
    only record the change (no I/O on the caller's thread)."""

    def stored(self, key: BlockHash, parent: BlockHash | None, slot: SlotId, job: JobId) -> None:
        """``key``'s G3 copy in ``slot``, written by ``job``, is ready."""

    def removed(self, key: BlockHash) -> None:
        """``key`` has no G3 copy any more."""


class BlockRegistry:
    """Hash -> :class:`BlockEntry`, plus one :class:`TierPool` per configured tier."""

    def __init__(self, capacities: dict[Tier, int], journal: DiskJournal | None = None) -> None:
        self.journal = journal
        self.blocks: dict[BlockHash, BlockEntry] = {}
        self.forgotten: list[BlockHash] = []  # blocks gone since the last take_forgotten()
        self.pools: dict[Tier, TierPool] = {
            tier: TierPool(tier, SlotAllocator(n)) for tier, n in capacities.items() if n > 0}

    # ------------------------------------------------------------------ lookups
    def get(self, key: BlockHash) -> BlockEntry | None:
        return self.blocks.get(key)

    def entry(self, key: BlockHash, parent: BlockHash | None = None) -> BlockEntry:
        found = self.blocks.get(key)
        if found is None:
            found = self.blocks[key] = BlockEntry(key, parent)
        return found

    def owner(self, tier: Tier, slot: SlotId) -> BlockHash | None:
        pool = self.pools.get(tier)
        return pool.owners.get(slot) if pool is not None else None

    def used(self, tier: Tier) -> int:
        pool = self.pools.get(tier)
        return pool.allocator.num_used if pool else 0

    def count_pinned(self, tier: Tier) -> int:
        pool = self.pools.get(tier)
        return pool.pinned if pool else 0

    # ------------------------------------------------------------------ copies
    def add_copy(self, entry: BlockEntry, tier: Tier, slot: SlotId, job: JobId | None) -> None:
        """Give ``entry`` a copy in ``slot`` (already taken from the allocator): pending for
        ``job``, or ready when ``job`` is None."""
        assert tier not in entry.copies, f"{entry.key.hex()} already has a {tier.label} copy"
        pool = self.pools[tier]
        entry.copies[tier] = TierCopy(slot, job)
        pool.owners[slot] = entry.key
        if entry.pins:
            pool.pinned += 1
        if job is None:  # NOTE: a pending copy changes no LRU membership (and is in none): no refresh
            self._refresh(entry)

    def take_copy(self, entry: BlockEntry, tier: Tier) -> SlotId:
        """Take a copy away from its block without freeing the slot (the caller reuses it)."""
        copy = entry.copies.pop(tier)
        if tier is Tier.DISK and self.journal is not None:
            self.journal.removed(entry.key)
        pool = self.pools[tier]
        pool.lru.remove(entry.key)
        if pool.owners.get(copy.slot) == entry.key:
            del pool.owners[copy.slot]
        if entry.pins:
            pool.pinned -= 1
        if not entry.copies:
            self.forget(entry.key)
        return copy.slot

    def drop_copy(self, entry: BlockEntry, tier: Tier) -> SlotId:
        """Remove the copy, free its slot, forget the block when no copy remains."""
        slot = self.take_copy(entry, tier)
        self.pools[tier].allocator.free(slot)
        return slot

    def mark_ready(self, entry: BlockEntry, tier: Tier) -> None:
        """Every worker wrote the copy: matchable (or, if it was condemned meanwhile, dropped)."""
        copy = entry.copies[tier]
        if tier is Tier.DISK and self.journal is not None and copy.job is not None and not copy.corrupt:
            self.journal.stored(entry.key, entry.parent, copy.slot, copy.job)
        copy.job = None
        self._refresh(entry)

    def condemn(self, entry: BlockEntry, tier: Tier) -> bool:
        """A worker reported this copy's bytes bad: never match it again; free its slot now if
        nobody reads or writes it, else once they are done. False if it was condemned already."""
        copy = entry.copies[tier]
        if copy.corrupt:
            return False
        copy.corrupt = True
        self._refresh(entry)
        return True

    # ------------------------------------------------------------------ readers
    def pin(self, entry: BlockEntry) -> None:
        entry.pins += 1
        if entry.pins == 1:  # every load pins each block of its hit: the hot path, kept to dict operations
            for tier in entry.copies:
                pool = self.pools[tier]
                pool.pinned += 1
                pool.lru.remove(entry.key)  # what _refresh does to a block that is not free

    def unpin(self, entry: BlockEntry) -> None:
        if entry.pins == 0:
            return  # settled after a reset, or twice: nothing is held
        entry.pins -= 1
        if entry.pins == 0:
            for tier in entry.copies:
                self.pools[tier].pinned -= 1
            self._refresh(entry)

    def set_busy(self, entry: BlockEntry, job: JobId | None) -> None:
        entry.busy_job = job
        self._refresh(entry)

    def touch(self, entry: BlockEntry, tier: Tier) -> None:
        """A hit on ``entry`` in ``tier``: most recently used there."""
        self.pools[tier].lru.touch(entry.key)

    def _refresh(self, entry: BlockEntry) -> None:
        """Bring the LRU membership of ``entry``'s copies in line with their state, and free
        the slots of condemned copies nobody uses any more."""
        free = entry.is_free
        for tier, copy in list(entry.copies.items()):
            lru = self.pools[tier].lru
            if copy.corrupt and free and copy.job is None:
                self.drop_copy(entry, tier)
            elif free and copy.is_ready:
                if entry.key not in lru:  # NOTE: a refresh is no use: keep the position
                    lru.insert(entry.key)
            else:
                lru.remove(entry.key)

    # ------------------------------------------------------------------ journal
    def forget(self, key: BlockHash) -> None:
        """Drop a block that has no copy left (journaled for the KV events)."""
        if self.blocks.pop(key, None) is not None:
            self.forgotten.append(key)

    def take_forgotten(self) -> list[BlockHash]:
        out, self.forgotten = self.forgotten, []
        return out
