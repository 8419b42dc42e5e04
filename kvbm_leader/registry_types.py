"""The block registry's state types and the views on them (:mod:`.registry` changes them).

Layout: no Python object per block. Python's cyclic collector traverses every container
object it tracks at each full collection, on the event loop's thread; a dict or tuple holding
only ints, bytes, bools and None is not tracked. So a block's state lies in such dicts, keyed
by its hash (``benchmarks/gc_pause.py``; ``tests/kvbm_leader/test_registry_gc.py``):

* ``BlockRegistry.parents``: every known block -> its parent (None for a first block): the set
  of blocks;
* ``TierPool.ready``: each ready copy of the tier -> its slot (a load's lookup is one get);
* ``TierPool.unready``: each pending or corrupt copy -> ``(slot, job, corrupt)``, a tuple of
  atomic values (the collector stops tracking it at the first collection that sees it);
* ``BlockRegistry.pins`` (pinned blocks -> loads in flight) and ``BlockRegistry.busy`` (blocks
  a demotion or promotion reads -> its job): only while nonzero / set.

:class:`BlockEntry` is a handle (registry, key) made on demand that reads and changes these;
:attr:`BlockRegistry.blocks` maps each hash to one.

Invariants: the views (:class:`BlockEntry`, :class:`_Blocks`) store nothing but their handle
and read the registry live; :class:`TierCopy` and :attr:`BlockEntry.copies` are snapshots;
a :class:`TierPool` is changed only by :class:`~.registry.BlockRegistry`, which keeps its
invariants; a :class:`DiskJournal` only records a change, on the caller's thread (no I/O).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Mapping, NamedTuple, Protocol

from kvbm_client.ids import BlockHash, JobId, SlotId, Tier

from .allocator import SlotAllocator
from .policies.lru import LRUPolicy

if TYPE_CHECKING:
    from .registry import BlockRegistry

#: A pending or corrupt copy: (slot, the job writing it or None once written, corrupt). A plain
#: tuple of atomic values, so the collector stops tracking it (a :class:`TierCopy` would stay tracked).
Unready = tuple[SlotId, JobId | None, bool]


class TierCopy(NamedTuple):
    """One copy of a block in one tier, as read (:attr:`BlockEntry.copies`): a snapshot."""

    slot: SlotId
    job: JobId | None  # the store/demote/promote job writing it; None once written
    corrupt: bool = False  # its bytes failed verification: never matched, freed when unused

    @property
    def is_ready(self) -> bool:
        return self.job is None and not self.corrupt


class BlockEntry:
    """Everything the leader knows about one logical block (all ranks' shards together): a
    handle on ``registry``'s state for ``key``, read live (nothing is stored in it)."""

    __slots__ = ("registry", "key")

    def __init__(self, registry: BlockRegistry, key: BlockHash) -> None:
        self.registry = registry
        self.key = key

    def __repr__(self) -> str:
        return f"BlockEntry({self.key.hex()}, copies={self.copies}, pins={self.pins}, busy_job={self.busy_job})"

    @property
    def parent(self) -> BlockHash | None:
        return self.registry.parents.get(self.key)

    @property
    def pins(self) -> int:
        """Loads in flight."""
        return self.registry.pins.get(self.key, 0)

    @property
    def busy_job(self) -> JobId | None:
        """A demotion (reads G2) or promotion (reads G3) of this block."""
        return self.registry.busy.get(self.key)

    @property
    def copies(self) -> dict[Tier, TierCopy]:
        """Its copies now, per tier (a snapshot: change them through the registry)."""
        key, out = self.key, dict[Tier, TierCopy]()
        for tier, pool in self.registry.pools.items():
            slot = pool.ready.get(key)
            if slot is not None:
                out[tier] = TierCopy(slot, None)
            elif (unready := pool.unready.get(key)) is not None:
                out[tier] = TierCopy(*unready)
        return out

    def ready_in(self, tier: Tier) -> bool:
        pool = self.registry.pools.get(tier)
        return pool is not None and self.key in pool.ready

    @property
    def is_free(self) -> bool:
        """Nobody reads the block now: no load pins it, no demotion or promotion copies it."""
        return self.registry.is_free_key(self.key)


@dataclass
class TierPool:
    """Capacity, free slots, slot owners, the copies and the LRU order of the evictable copies
    of one tier."""

    tier: Tier
    allocator: SlotAllocator
    lru: LRUPolicy = field(default_factory=LRUPolicy)
    owners: dict[SlotId, BlockHash] = field(default_factory=dict)
    ready: dict[BlockHash, SlotId] = field(default_factory=dict)  # ready copies -> slot
    unready: dict[BlockHash, Unready] = field(default_factory=dict)  # pending or corrupt copies
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


class _Blocks(Mapping[BlockHash, BlockEntry]):
    """Hash -> :class:`BlockEntry` of every known block (a live view over ``parents``)."""

    __slots__ = ("_reg",)

    def __init__(self, registry: BlockRegistry) -> None:
        self._reg = registry

    def __getitem__(self, key: BlockHash) -> BlockEntry:
        if key not in self._reg.parents:
            raise KeyError(key)
        return BlockEntry(self._reg, key)

    def __contains__(self, key: object) -> bool:
        return key in self._reg.parents

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(self._reg.parents)

    def __len__(self) -> int:
        return len(self._reg.parents)
