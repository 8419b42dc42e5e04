"""Block registry: which sequence hash lives in which tier and slot, and in what state.

Runs in the leader; pure and synchronous. A block may have one copy per tier (G2, G3).
A copy is *pending* from the moment its slot is reserved until every worker confirmed the
bytes landed; only *ready* copies are matchable. ``pins`` counts loads in flight reading the
block; ``busy_job`` names a demotion or promotion reading it. A pinned or busy block is
never evicted, in any tier.

Layout: no Python object per block; the state lies in dicts of atomic values (``parents``,
``pins``, ``busy`` here, one :class:`~.registry_types.TierPool` per tier), read through
:class:`~.registry_types.BlockEntry` handles: :mod:`.registry_types` explains it. The
key-level methods (``*_key``, :meth:`~BlockRegistry.load_slot`, :meth:`~BlockRegistry.settle`)
are the same operations without a handle, for the per-key loops of :mod:`.steps`; a load's
lookup, pins and unpins (``load_slots``, ``pin_keys``, ``unpin_keys``) take its whole prefix at
once, in C-level passes where they can (``tests/kvbm_leader/test_registry_batches.py`` holds
them to the one-key-at-a-time model).

Invariants kept here (every state change goes through a method of :class:`BlockRegistry`):

* a block is in ``parents`` while it has a copy (one with none is forgotten); ``pins`` and
  ``busy`` hold only blocks in ``parents``; a copy is in exactly one of its tier's ``ready``
  and ``unready``;
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

from typing import Mapping, Sequence

from kvbm_client.ids import BlockHash, JobId, SlotId, Tier

from .allocator import SlotAllocator
# The state types and views live in .registry_types; re-exported (``X as X``) for the callers.
from .registry_types import BlockEntry as BlockEntry, DiskJournal as DiskJournal, TierCopy as TierCopy
from .registry_types import TierPool as TierPool, Unready as Unready, _Blocks


_LOAD_ORDER = (Tier.HOST, Tier.DISK)


class BlockRegistry:
    """The blocks (``parents``, ``pins``, ``busy``) and one :class:`TierPool` per configured tier."""

    def __init__(self, capacities: dict[Tier, int], journal: DiskJournal | None = None) -> None:
        self.journal = journal
        self.parents: dict[BlockHash, BlockHash | None] = {}  # every known block -> its parent
        self.pins: dict[BlockHash, int] = {}  # pinned blocks -> loads in flight (> 0)
        self.busy: dict[BlockHash, JobId] = {}  # blocks a demotion or promotion reads -> its job
        self.forgotten: list[BlockHash] = []  # blocks gone since the last take_forgotten()
        self.pools: dict[Tier, TierPool] = {
            tier: TierPool(tier, SlotAllocator(n)) for tier, n in capacities.items() if n > 0}
        # (tier, its ready copies) fastest first: what a load looks up per block
        self._load_order = tuple((t, self.pools[t].ready) for t in _LOAD_ORDER if t in self.pools)

    # ------------------------------------------------------------------ lookups
    @property
    def blocks(self) -> Mapping[BlockHash, BlockEntry]:
        """Hash -> :class:`BlockEntry` of every known block (read-only, live)."""
        return _Blocks(self)

    def get(self, key: BlockHash) -> BlockEntry | None:
        return BlockEntry(self, key) if key in self.parents else None

    def entry(self, key: BlockHash, parent: BlockHash | None = None) -> BlockEntry:
        """The block ``key``, known from now on (``parent`` is kept only for a new one)."""
        self.parents.setdefault(key, parent)
        return BlockEntry(self, key)

    def owner(self, tier: Tier, slot: SlotId) -> BlockHash | None:
        pool = self.pools.get(tier)
        return pool.owners.get(slot) if pool is not None else None

    def used(self, tier: Tier) -> int:
        pool = self.pools.get(tier)
        return pool.allocator.num_used if pool else 0

    def count_pinned(self, tier: Tier) -> int:
        pool = self.pools.get(tier)
        return pool.pinned if pool else 0

    def has_copy(self, key: BlockHash, tier: Tier) -> bool:
        """Whether ``key`` has a copy (ready, pending or corrupt) in ``tier``."""
        pool = self.pools.get(tier)
        return pool is not None and (key in pool.ready or key in pool.unready)

    def load_slot(self, key: BlockHash) -> tuple[Tier, SlotId] | None:
        """The fastest tier holding a ready copy of ``key`` and its slot (every load asks this
        per block: kept to one dict lookup per tier)."""
        for tier, ready in self._load_order:
            slot = ready.get(key)
            if slot is not None:
                return tier, slot
        return None

    def load_slots(self, keys: Sequence[BlockHash]) -> tuple[list[Tier], list[SlotId]]:
        """:meth:`load_slot` of each of ``keys`` up to the first one without a ready copy:
        (tiers, slots) of that prefix. A whole prefix in the fastest tier (a warm G2 hit, every
        load's common case) costs one C-level pass; a mixed one is walked key by key from its
        first block the fastest tier lacks."""
        if not self._load_order:
            return [], []
        fast, fast_ready = self._load_order[0]
        slots: list[SlotId | None] = list(map(fast_ready.get, keys))
        try:
            n = slots.index(None)
        except ValueError:
            return [fast] * len(slots), slots  # type: ignore[return-value]  # no None in it
        tiers, found = [fast] * n, slots[:n]
        for key in keys[n:]:
            copy = self.load_slot(key)
            if copy is None:
                break
            tiers.append(copy[0])
            found.append(copy[1])
        return tiers, found  # type: ignore[return-value]  # the Nones stop the walk

    def is_free_key(self, key: BlockHash) -> bool:
        """Nobody reads ``key`` now: no load pins it, no demotion or promotion copies it."""
        return key not in self.pins and key not in self.busy

    # ------------------------------------------------------------------ copies
    def add_copy(self, entry: BlockEntry, tier: Tier, slot: SlotId, job: JobId | None) -> None:
        """Give ``entry`` a copy in ``slot`` (already taken from the allocator): pending for
        ``job``, or ready when ``job`` is None."""
        self.add_copy_key(entry.key, None, tier, slot, job)

    def add_copy_key(self, key: BlockHash, parent: BlockHash | None, tier: Tier, slot: SlotId,
                     job: JobId | None) -> None:
        """:meth:`entry` (``key``, ``parent``) then :meth:`add_copy`."""
        pool = self.pools[tier]
        assert key not in pool.ready and key not in pool.unready, f"{key.hex()} already has a {tier.label} copy"
        self.parents.setdefault(key, parent)
        pool.owners[slot] = key
        if key in self.pins:
            pool.pinned += 1
        if job is None:
            pool.ready[key] = slot
            self._refresh(key)
        else:  # NOTE: a pending copy changes no LRU membership (and is in none): no refresh
            pool.unready[key] = (slot, job, False)

    def take_copy(self, entry: BlockEntry, tier: Tier) -> SlotId:
        """Take a copy away from its block without freeing the slot (the caller reuses it)."""
        return self.take_copy_key(entry.key, tier)

    def take_copy_key(self, key: BlockHash, tier: Tier) -> SlotId:
        pool = self.pools[tier]
        slot = pool.ready.pop(key, None)
        if slot is None:
            slot = pool.unready.pop(key)[0]
        if tier is Tier.DISK and self.journal is not None:
            self.journal.removed(key)
        pool.lru.remove(key)
        if pool.owners.get(slot) == key:
            del pool.owners[slot]
        if key in self.pins:
            pool.pinned -= 1
        if not any(key in p.ready or key in p.unready for p in self.pools.values()):
            self.forget(key)
        return slot

    def drop_copy(self, entry: BlockEntry, tier: Tier) -> SlotId:
        """Remove the copy, free its slot, forget the block when no copy remains."""
        return self.drop_copy_key(entry.key, tier)

    def drop_copy_key(self, key: BlockHash, tier: Tier) -> SlotId:
        slot = self.take_copy_key(key, tier)
        self.pools[tier].allocator.free(slot)
        return slot

    def mark_ready(self, entry: BlockEntry, tier: Tier) -> None:
        """Every worker wrote the copy: matchable (or, if it was condemned meanwhile, dropped)."""
        self._mark_ready(entry.key, tier)

    def _mark_ready(self, key: BlockHash, tier: Tier) -> None:
        pool = self.pools[tier]
        unready = pool.unready.get(key)
        if unready is None:  # ready already
            if key not in pool.ready:
                raise KeyError(key)
        else:
            slot, job, corrupt = unready
            if tier is Tier.DISK and self.journal is not None and job is not None and not corrupt:
                self.journal.stored(key, self.parents.get(key), slot, job)
            if corrupt:
                pool.unready[key] = (slot, None, True)
            else:
                del pool.unready[key]
                pool.ready[key] = slot
        self._refresh(key)

    def settle(self, key: BlockHash, tier: Tier, job: JobId, ready: bool) -> bool:
        """``job``'s copy of ``key`` in ``tier`` is written (``ready``: every worker confirmed
        it) or not: ready it, or drop it (as when it was condemned meanwhile). True if made
        ready; a copy not pending for ``job`` is left alone (False)."""
        pool = self.pools.get(tier)
        unready = pool.unready.get(key) if pool is not None else None
        if unready is None or unready[1] != job:
            return False
        if ready and not unready[2]:
            self._mark_ready(key, tier)
            return True
        self.drop_copy_key(key, tier)
        return False

    def condemn(self, entry: BlockEntry, tier: Tier) -> bool:
        """A worker reported this copy's bytes bad: never match it again; free its slot now if
        nobody reads or writes it, else once they are done. False if it was condemned already."""
        key, pool = entry.key, self.pools[tier]
        slot = pool.ready.pop(key, None)
        if slot is not None:
            pool.unready[key] = (slot, None, True)
        else:
            slot, job, corrupt = pool.unready[key]
            if corrupt:
                return False
            pool.unready[key] = (slot, job, True)
        self._refresh(key)
        return True

    # ------------------------------------------------------------------ readers
    def pin_keys(self, keys: Sequence[BlockHash]) -> None:
        """A load reads each of ``keys`` (known blocks; one pin per occurrence): a block's first
        pin takes its copies out of the LRUs until its last pin goes. In C-level passes: a load
        pins every block of its hit, 1258 for a 20K-token prompt."""
        pins = self.pins
        fresh = [k for k in keys if k not in pins]
        if len(fresh) == len(keys) and len(set(fresh)) == len(fresh):
            pins.update(dict.fromkeys(fresh, 1))
        else:  # some pinned already, or repeated: count each pin, unpin them one by one later
            fresh = list(dict.fromkeys(fresh))
            for key in keys:
                pins[key] = pins.get(key, 0) + 1
        for pool in self.pools.values():
            ready, unready = pool.ready, pool.unready
            held = [k for k in fresh if k in ready or k in unready]
            pool.pinned += len(held)
            pool.lru.remove_many(held)  # what _refresh does to a block that is not free

    def unpin_keys(self, keys: Sequence[BlockHash]) -> None:
        """A load that read ``keys`` ended (a load's settle: every block of its hit): one pin
        less per occurrence (a key no longer pinned is skipped: settled after a reset, or
        twice). The blocks whose last pin goes come back into their tiers' LRUs as most
        recently used, in ``keys``' order; their condemned copies nobody uses any more are
        freed."""
        pins = self.pins
        counts = list(map(pins.get, keys))
        if counts.count(1) == len(keys) and len(set(keys)) == len(keys):
            released = list(keys)
            for key in released:
                del pins[key]
        else:
            released = []
            for key in keys:
                count = pins.get(key, 0)
                if count > 1:
                    pins[key] = count - 1
                elif count == 1:
                    del pins[key]
                    released.append(key)
        if not released:
            return
        busy = self.busy
        for tier, pool in self.pools.items():
            ready, unready, lru = pool.ready, pool.unready, pool.lru
            here = [k for k in released if k in ready]
            pending = [k for k in released if k in unready] if unready else []
            pool.pinned -= len(here) + len(pending)
            if busy:  # read by a demotion or promotion: stays out of the LRU
                lru.remove_many([k for k in here if k in busy])
                here = [k for k in here if k not in busy]
            lru.add_many(here)
            for key in pending:
                self._refresh_copy(key, tier, pool)

    def set_busy(self, entry: BlockEntry, job: JobId | None) -> None:
        key = entry.key
        if job is None:
            self.busy.pop(key, None)
        elif key in self.parents:  # a forgotten block has nothing to hold
            self.busy[key] = job
        self._refresh(key)

    def _refresh(self, key: BlockHash) -> None:
        """Bring the LRU membership of ``key``'s copies in line with their state, and free
        the slots of condemned copies nobody uses any more."""
        free = key not in self.pins and key not in self.busy
        for tier, pool in self.pools.items():
            lru = pool.lru
            if key in pool.ready:
                if not free:
                    lru.remove(key)
                elif key not in lru:  # NOTE: a refresh is no use: keep the position
                    lru.insert(key)
            elif key in pool.unready:
                self._refresh_copy(key, tier, pool)

    def _refresh_copy(self, key: BlockHash, tier: Tier, pool: TierPool) -> None:
        """:meth:`_refresh` of ``key``'s pending or corrupt copy in ``tier``: a condemned copy
        nobody uses any more is dropped; any other stays out of the LRU."""
        slot, job, corrupt = pool.unready[key]
        if corrupt and job is None and key not in self.pins and key not in self.busy:
            self.drop_copy_key(key, tier)
        else:
            pool.lru.remove(key)

    # ------------------------------------------------------------------ journal
    def forget(self, key: BlockHash) -> None:
        """Drop a block that has no copy left (journaled for the KV events)."""
        if key in self.parents:
            del self.parents[key]
            self.pins.pop(key, None)
            self.busy.pop(key, None)
            self.forgotten.append(key)

    def take_forgotten(self) -> list[BlockHash]:
        out, self.forgotten = self.forgotten, []
        return out
