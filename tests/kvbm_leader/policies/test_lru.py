"""LRUPolicy: ordering only; the caller decides what is evictable."""
from __future__ import annotations

import pytest

from kvbm_client.ids import BlockHash
from kvbm_leader.policies.lru import LRUPolicy


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(8, "big"))


def make_lru(*ids: int) -> LRUPolicy:
    lru = LRUPolicy()
    for i in ids:
        lru.insert(key(i))
    return lru


def order(lru: LRUPolicy) -> list[int]:
    return [int.from_bytes(k, "big") for k in lru.candidates()]


def test_insert_order_is_least_recent_first() -> None:
    lru = make_lru(1, 2, 3)
    assert order(lru) == [1, 2, 3]
    assert len(lru) == 3
    assert key(2) in lru and key(9) not in lru


def test_reinsert_moves_to_most_recent_without_duplicating() -> None:
    lru = make_lru(1, 2, 3)
    lru.insert(key(1))
    assert order(lru) == [2, 3, 1]
    assert len(lru) == 3


def test_touch_moves_to_most_recent_and_ignores_unknown_keys() -> None:
    lru = make_lru(1, 2, 3)
    lru.touch(key(2))
    lru.touch(key(42))
    assert order(lru) == [1, 3, 2]
    assert key(42) not in lru


def test_remove_is_idempotent() -> None:
    lru = make_lru(1, 2, 3)
    lru.remove(key(2))
    lru.remove(key(2))
    assert order(lru) == [1, 3]


@pytest.mark.parametrize("blocked, expected", [
    (set(), 1),
    ({1}, 2),
    ({1, 2}, 3),
    ({1, 2, 3}, None),
])
def test_pick_victim_returns_lru_evictable_and_never_mutates(blocked: set[int], expected: int | None) -> None:
    lru = make_lru(1, 2, 3)

    victim = lru.pick_victim(lambda k: int.from_bytes(k, "big") not in blocked)

    assert victim == (key(expected) if expected is not None else None)
    assert order(lru) == [1, 2, 3]


def test_pick_victim_respects_scan_limit() -> None:
    lru = make_lru(1, 2, 3)
    seen: list[int] = []

    def evictable(k: BlockHash) -> bool:
        seen.append(int.from_bytes(k, "big"))
        return int.from_bytes(k, "big") == 3

    assert lru.pick_victim(evictable, limit=2) is None
    assert seen == [1, 2]
    assert lru.pick_victim(evictable, limit=3) == key(3)


def test_pick_victim_on_empty_policy() -> None:
    assert LRUPolicy().pick_victim(lambda k: True) is None
