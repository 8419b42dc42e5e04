"""The worker side's bookkeeping of transfers in flight (``connectors/core/transfers.py``),
driven with futures the test completes. No daemon, no engine."""
from __future__ import annotations

from concurrent.futures import Future

import grpc
import pytest

from kvbm_client.connectors.core import TransferTracker


class Failed(grpc.RpcError):
    def __init__(self, code=grpc.StatusCode.UNAVAILABLE, details="worker went away") -> None:
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def done(value="ok") -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def failed(exc: BaseException | None = None) -> Future:
    f: Future = Future()
    f.set_exception(exc or Failed())
    return f


@pytest.fixture
def seen():
    return {"failures": [], "loads": []}


@pytest.fixture
def tracker(seen) -> TransferTracker:
    return TransferTracker(on_failure=seen["failures"].append,
                           on_load_done=lambda req, item, answer, mode: seen["loads"].append((req, answer, mode)))


def test_synchronous_loads_are_waited_for_before_the_forward(tracker, seen):
    ok, bad = done("answer"), failed()
    tracker.load_sent("a", ok, [1, 2], sync=True)
    tracker.load_sent("b", bad, [3, 4], sync=True)
    tracker.settle_sync_loads()
    assert seen["loads"] == [("a", "answer", "sync"), ("b", None, "sync")]
    assert tracker.take_load_errors() == {3, 4}, "the engine recomputes the failed load's blocks"
    assert tracker.take_load_errors() == set(), "reported once"
    assert [type(e) for e in seen["failures"]] == [Failed]
    assert tracker.finished() == (set(), set()), "synchronous loads are not reported as received"


def test_an_asynchronous_load_is_reported_once_when_done_and_never_waited_for(tracker):
    pending: Future = Future()
    tracker.load_sent("a", pending, [1], sync=False)
    assert tracker.finished() == (set(), set())
    pending.set_result("ok")
    assert tracker.finished() == (set(), {"a"})
    assert tracker.finished() == (set(), set())
    assert tracker.take_load_errors() == set()


def test_a_failed_asynchronous_load_is_received_with_its_blocks_as_errors(tracker):
    tracker.load_sent("a", failed(Failed(grpc.StatusCode.DATA_LOSS, "bad checksum")), [5, 6], sync=False)
    assert tracker.finished() == (set(), {"a"})
    assert tracker.take_load_errors() == {5, 6}


@pytest.mark.parametrize("sync", [True, False])
def test_a_load_that_could_not_be_sent_fails_its_blocks_at_once(tracker, sync):
    tracker.load_sent("a", None, [7, 8], sync=sync)
    assert tracker.take_load_errors() == {7, 8}
    tracker.settle_sync_loads()
    assert tracker.finished() == (set(), set() if sync else {"a"}), "an asynchronous request must not wait forever"


def test_a_finished_request_is_freed_only_when_its_stores_are_done(tracker):
    first, second = Future(), Future()
    tracker.store_sent(first, [1, 2], ["a", "b"])
    tracker.store_sent(second, [3], ["a"])
    assert tracker.finished(["a", "b"]) == (set(), set())
    first.set_result("ok")
    assert tracker.finished() == ({"b"}, set()), "a still has a store in flight"
    second.set_exception(Failed())
    assert tracker.finished() == ({"a"}, set()), "a failed store also releases the blocks"
    assert tracker.finished() == (set(), set())
    assert tracker.stores_in_flight == 0


def test_a_request_without_stores_in_flight_is_freed_at_once(tracker):
    assert tracker.finished(["a"]) == ({"a"}, set())


def test_a_fence_waits_for_every_store(tracker, seen):
    slow: Future = Future()
    tracker.store_sent(done(), [1], ["a"])
    tracker.store_sent(failed(), [2], ["b"])
    slow.set_result("ok")  # completes while the engine waits in fence()
    tracker.store_sent(slow, [3], ["c"])
    tracker.fence()
    assert tracker.stores_in_flight == 0
    assert len(seen["failures"]) == 1
    assert tracker.finished(["a", "b", "c"]) == ({"a", "b", "c"}, set())


def test_a_cancelled_transfer_is_a_failure_not_a_crash(tracker, seen):
    cancelled: Future = Future()
    cancelled.cancel()
    tracker.load_sent("a", cancelled, [9], sync=True)
    tracker.settle_sync_loads()
    assert tracker.take_load_errors() == {9}
    assert len(seen["failures"]) == 1
