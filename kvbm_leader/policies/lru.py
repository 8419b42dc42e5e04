"""LRU order of the blocks held by one tier.

Runs in the leader; pure and synchronous. The policy only orders; whether a block may be
evicted now (pins, pending copies) is the caller's predicate, so a rejected candidate is
left in place and nothing changes when no victim qualifies.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterator

from kvbm_client.ids import BlockHash


class LRUPolicy:
    """Least recently used first."""

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

    def touch(self, key: BlockHash) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: BlockHash) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[BlockHash]:
        """Keys from least to most recently used (do not mutate while iterating)."""
        return iter(self._order)

    def pick_victim(self, evictable: Callable[[BlockHash], bool], limit: int = 1 << 30) -> BlockHash | None:
        """The least recently used key for which ``evictable`` holds, looking at most ``limit``
        keys; ``None`` (and no change) when none does."""
        for i, key in enumerate(self._order):
            if i >= limit:
                break
            if evictable(key):
                return key
        return None
