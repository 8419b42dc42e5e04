"""Slot allocator of one tier: which slots of the workers' pools are free.

Runs in the leader; pure and synchronous. Invariant: a slot is either free or owned by
exactly one block copy; a double free or a foreign slot raises.
"""
from __future__ import annotations

from typing import Iterable

from kvbm_client.ids import SlotId


class SlotAllocator:
    """Free list over slots ``0 .. capacity-1``; lowest slots are handed out first."""

    __slots__ = ("capacity", "_free", "_free_set")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        # NOTE: a stack popped from the end, filled in reverse, so slot 0 goes first; keeps
        # the in-use region of the pool dense (friendlier to the disk file and to status).
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._free_set: set[int] = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self) -> SlotId | None:
        """A free slot, or ``None`` when the tier is full (nothing changes then)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._free_set.discard(slot)
        return SlotId(slot)

    def reserve(self, slots: Iterable[SlotId]) -> set[SlotId]:
        """Take these slots now (a G3 restore); returns those that were free and are now taken
        (the others are left as they were). One pass over the free list."""
        wanted = set(slots) & self._free_set
        if wanted:
            self._free = [s for s in self._free if s not in wanted]
            self._free_set -= wanted
        return {SlotId(s) for s in wanted}

    def free(self, slot: SlotId) -> None:
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} outside 0..{self.capacity - 1}")
        if slot in self._free_set:
            raise ValueError(f"slot {slot} freed twice")
        self._free.append(slot)
        self._free_set.add(slot)
