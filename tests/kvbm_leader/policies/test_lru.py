"""LRUPolicy: the order of the evictable copies of one tier; a victim is a pop."""
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


def test_pop_victim_takes_the_least_recent_key() -> None:
    lru = make_lru(1, 2, 3)
    lru.touch(key(1))

    assert lru.pop_victim() == key(2)

    assert order(lru) == [3, 1]
    assert key(2) not in lru


def test_pop_victim_on_empty_policy_changes_nothing() -> None:
    lru = LRUPolicy()
    assert lru.pop_victim() is None
    assert len(lru) == 0


def test_pop_victim_is_constant_time_whatever_the_size() -> None:
    """Only evictable keys are held, so a victim is a pop: popping every key of a big policy
    touches each key once (no scan), which this bounds by counting hash calls."""
    calls = 0

    class CountingKey(bytes):
        def __hash__(self) -> int:
            nonlocal calls
            calls += 1
            return bytes.__hash__(self)

    lru = LRUPolicy()
    n = 2000
    for i in range(n):
        lru.insert(BlockHash(CountingKey(i.to_bytes(8, "big"))))
    calls = 0
    popped = [lru.pop_victim() for _ in range(n)]
    assert popped == [key(i) for i in range(n)]
    assert calls <= 2 * n
