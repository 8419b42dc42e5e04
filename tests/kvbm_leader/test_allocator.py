"""SlotAllocator: the free list of one tier (pure, synchronous)."""
from __future__ import annotations

import pytest

from kvbm_client.ids import SlotId
from kvbm_leader.allocator import SlotAllocator


def make_full(capacity: int) -> tuple[SlotAllocator, list[SlotId]]:
    """An allocator with every slot handed out, plus the slots in allocation order."""
    alloc = SlotAllocator(capacity)
    slots = [alloc.allocate() for _ in range(capacity)]
    assert None not in slots
    return alloc, slots  # type: ignore[return-value]


@pytest.mark.parametrize("capacity", [1, 4, 17])
def test_hands_out_lowest_slots_first_in_order(capacity: int) -> None:
    alloc = SlotAllocator(capacity)
    assert (alloc.num_free, alloc.num_used) == (capacity, 0)

    got = [alloc.allocate() for _ in range(capacity)]

    assert got == list(range(capacity))
    assert (alloc.num_free, alloc.num_used) == (0, capacity)


@pytest.mark.parametrize("capacity", [0, 1, 3])
def test_full_tier_returns_none_and_changes_nothing(capacity: int) -> None:
    alloc, _ = make_full(capacity)

    assert alloc.allocate() is None
    assert alloc.allocate() is None
    assert (alloc.num_free, alloc.num_used) == (0, capacity)


def test_freed_slot_is_reused_before_untouched_slots() -> None:
    alloc = SlotAllocator(8)
    for _ in range(4):
        alloc.allocate()  # 0..3 in use

    alloc.free(SlotId(1))

    assert alloc.num_used == 3
    assert alloc.allocate() == 1  # dense: the hole is filled before slot 4
    assert alloc.allocate() == 4


def test_free_then_allocate_round_trips_every_slot() -> None:
    alloc, slots = make_full(5)
    for slot in slots:
        alloc.free(slot)
    assert alloc.num_free == 5

    again = sorted(alloc.allocate() for _ in range(5))  # type: ignore[type-var]

    assert again == slots
    assert alloc.allocate() is None


def test_double_free_raises_and_keeps_the_slot_once() -> None:
    alloc, _ = make_full(3)
    alloc.free(SlotId(2))

    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(SlotId(2))

    assert alloc.num_free == 1
    assert alloc.allocate() == 2
    assert alloc.allocate() is None  # slot 2 was not put on the free list twice


def test_freeing_a_never_allocated_slot_raises() -> None:
    alloc = SlotAllocator(4)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(SlotId(3))
    assert alloc.num_free == 4


@pytest.mark.parametrize("slot", [-1, 4, 100])
def test_foreign_slot_raises(slot: int) -> None:
    alloc, _ = make_full(4)

    with pytest.raises(ValueError, match="outside"):
        alloc.free(SlotId(slot))

    assert alloc.num_free == 0


def test_negative_capacity_is_rejected() -> None:
    with pytest.raises(ValueError):
        SlotAllocator(-1)
