"""LRU order of the blocks one tier may evict now.

Runs in the leader; pure and synchronous. The policy holds only *evictable* copies (ready,
unpinned, not being read by a demotion or promotion): the registry removes a copy when it
stops being evictable and re-inserts it, as most recently used, when it becomes evictable
again. So choosing a victim is a pop from the front, never a scan past pinned or pending
keys, and every operation is O(1) per key (a load's whole prefix goes in or out in one
C-level pass: ``add_many``, ``remove_many``).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from typing import Iterable, Iterator

from kvbm_client.ids import BlockHash


class LRUPolicy:
    """Least recently used first, over the evictable copies of one tier."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._order

    def insert(self, key: BlockHash) -> None:
        """Add ``key`` as most recently used (or move it there)."""
        self._order[key] = None
        self._order.move_to_end(key)

    def add_many(self, keys: Iterable[BlockHash]) -> None:
        """Add the ``keys`` not held yet as most recently used, in order; a held key keeps its
        place (as :meth:`insert` would not: a key that comes back after a pin, not a use)."""
        self._order.update(dict.fromkeys(keys))

    def touch(self, key: BlockHash) -> None:
        """A use of ``key``: most recently used (unknown keys are ignored)."""
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: BlockHash) -> None:
        self._order.pop(key, None)

    def remove_many(self, keys: Iterable[BlockHash]) -> None:
        """:meth:`remove` of each of ``keys`` (in one C-level pass)."""
        deque(map(self._order.pop, keys, repeat(None)), maxlen=0)

    def candidates(self) -> Iterator[BlockHash]:
        """Keys from least to most recently used (do not mutate while iterating)."""
        return iter(self._order)

    def pop_victim(self) -> BlockHash | None:
        """Remove and return the least recently used key; ``None`` (no change) when empty."""
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key
