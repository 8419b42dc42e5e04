"""Block holds (``connectors/core/block_holds.py``) alone, over a fake pool: the blocks a store
reads stay pinned from the ask until every worker side reported the store settled. The scheduler
core's use of them is in test_connector_core_scheduler.py and test_store_planner.py, the worker
core's reports in test_connector_core_worker.py."""
from __future__ import annotations

from collections import Counter

import pytest

from kvbm_client.connectors.core.block_holds import EXPIRY_MARGIN_S, BlockHolds
from kvbm_client.ids import EngineBlockId
from support.fake_pool import FakePool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def B(*ids: int) -> list[EngineBlockId]:
    return [EngineBlockId(i) for i in ids]


# ---------------------------------------------------------------------------- the holds alone
def test_a_hold_pins_from_the_ask_keeps_what_was_planned_and_ends_with_the_last_report():
    pool, clock = FakePool(), Clock()
    holds = BlockHolds(pool, reporters=2, clock=clock)
    h = holds.hold(B(1, 2, 3))
    assert pool.pinned == {1, 2, 3} and holds.pending
    clock.now += 10_000
    holds.expire()
    assert pool.pinned == {1, 2, 3}, "a hold whose store is not planned yet never expires"
    assert holds.narrow(h, B(1, 3), deadline=clock.now + 30)
    assert pool.pinned == {1, 3}, "the block the leader did not plan is free at once"
    holds.settled([h])
    assert pool.pinned == {1, 3}, "one worker side of two reported"
    holds.settled([h])
    assert pool.pinned == set() and not holds.pending


def test_a_store_the_leader_planned_none_of_releases_every_block():
    pool = FakePool()
    holds = BlockHolds(pool)
    h = holds.hold(B(4, 5))
    assert not holds.narrow(h, (), 0.0)
    assert pool.pinned == set() and not holds.pending
    holds.settled([h])  # a stray report of a released hold changes nothing
    assert pool.refs == Counter()


def test_an_unreported_store_is_freed_only_after_its_deadline_plus_the_margin():
    pool, clock = FakePool(), Clock()
    holds = BlockHolds(pool, clock=clock)
    h = holds.hold(B(6))
    holds.narrow(h, B(6), deadline=clock.now + 30)
    clock.now += 30 + EXPIRY_MARGIN_S - 0.1
    holds.expire()
    assert pool.pinned == {6}
    clock.now += 0.2
    holds.expire()
    assert pool.pinned == set()


def test_a_block_in_two_stores_stays_pinned_until_both_settle_and_close_releases_all():
    pool = FakePool()
    holds = BlockHolds(pool)
    a, b = holds.hold(B(7, 8)), holds.hold(B(8, 9))
    holds.narrow(a, B(7, 8), 1.0)
    holds.narrow(b, B(8, 9), 1.0)
    holds.settled([a])
    assert pool.refs == Counter({8: 1, 9: 1})
    holds.close()
    assert pool.refs == Counter() and not holds.pending
    with pytest.raises(AssertionError):
        c = holds.hold(B(1))
        holds.narrow(c, B(2), 1.0)  # a plan of blocks the hold never held is a bug
