"""``kvbm_client.heap``: the start-up objects leave the collector's walk; later garbage is
still collected."""
from __future__ import annotations

import gc
import weakref

from kvbm_client.heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: "Node | None" = None


def test_frozen_startup_objects_leave_the_walk_and_later_cycles_are_still_collected():
    startup = [[i] for i in range(200_000)]  # long-lived, tracked: what a started daemon holds
    try:
        frozen = freeze_startup_heap("test")
        # Frozen objects still die when their last reference goes (a temporary the caller held
        # during the call, say), and leave the permanent generation then: the count may only fall.
        assert frozen >= len(startup) and len(startup) <= gc.get_freeze_count() <= frozen
        assert not any(o is startup for o in gc.get_objects()), "a frozen object is still walked"
        assert not any(o is startup[0] for o in gc.get_objects())
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None, "a cycle made after the freeze is still collected"
    finally:
        gc.unfreeze()
