"""The worker side's bookkeeping of transfers in flight (``connectors/core/transfers.py``),
driven with futures the test completes. No daemon, no engine."""
from __future__ import annotations

import time
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


# ---------------------------------------------------------------------------- unanswered loads (issue 17 window 3)
@pytest.fixture
def stopped() -> list:
    return []


@pytest.fixture
def guarded(seen, stopped) -> TransferTracker:
    """A tracker whose ``on_unanswered`` records the load it was called for (the worker core
    stops the daemon there)."""
    return TransferTracker(on_failure=seen["failures"].append, on_unanswered=stopped.append)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_load_whose_connection_broke_stops_the_daemon_before_it_counts_as_failed(guarded, stopped, code):
    guarded.load_sent("a", failed(Failed(code)), [1, 2], sync=True, answer_by=time.monotonic() + 60)
    assert guarded.settle_sync_loads() is True, "the step's synchronous load failed"
    assert [item.engine_blocks for item in stopped] == [[1, 2]]
    assert guarded.take_load_errors() == {1, 2}


def test_a_load_not_answered_by_its_deadline_stops_the_daemon(guarded, stopped):
    late: Future = Future()
    guarded.load_sent("a", late, [3], sync=False, answer_by=time.monotonic() - 1)
    late.set_exception(Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))  # our own deadline
    assert guarded.finished() == (set(), {"a"})
    assert len(stopped) == 1 and guarded.take_load_errors() == {3}


def test_a_load_the_daemon_refused_needs_no_stop(guarded, stopped):
    refused: Future = Future()
    guarded.load_sent("a", refused, [4], sync=True, answer_by=time.monotonic() + 60)
    refused.set_exception(Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "job 3 is past its deadline"))  # its answer
    guarded.load_sent("b", failed(Failed(grpc.StatusCode.ABORTED, "copy failed")), [5], sync=True)
    assert guarded.settle_sync_loads() is True
    assert stopped == [] and guarded.take_load_errors() == {4, 5}


def test_a_step_whose_synchronous_loads_succeeded_is_not_tainted(guarded):
    guarded.load_sent("a", done(), [1], sync=True)
    assert guarded.settle_sync_loads() is False
