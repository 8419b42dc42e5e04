"""The connectors' engine-independent worker core (``connectors/core/worker.py``) over a fake
region link: how long each call is waited for, and which stores a failed load drops. No
daemon, no engine (the daemon-level windows are in tests/stress/test_windows_daemons.py)."""
from __future__ import annotations

import time
from concurrent.futures import Future

import grpc
import pytest

from kvbm_client.connectors.core import ConnectorSettings, LoadSpec, StoreSpec, WorkerCore
from kvbm_client.connectors.core.worker import ANSWER_MARGIN_S, NO_DEADLINE_WAIT_S
from kvbm_client.ids import WorkerId


class Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.ABORTED

    def details(self):
        return "copy failed"


class FakeLink:
    """Answers every call at once: plans named in ``failing`` fail, the others succeed."""

    def __init__(self, failing: set[bytes] = frozenset()) -> None:
        self.failing = failing
        self.sent: list[tuple[bytes, float | None]] = []

    def submit(self, plan, signature, blocks, timeout=None, layer_groups=0, gpu=None):
        self.sent.append((plan, timeout))
        self.layer_groups = layer_groups
        future: Future = Future()
        if plan in self.failing:
            future.set_exception(Refused())
        else:
            future.set_result("ok")
        return future

    def failed(self, exc):
        pass

    def close(self):
        pass


def core(link: FakeLink, overlapping_steps: int = 1) -> WorkerCore:
    settings = ConnectorSettings("unix:/nowhere/l.sock", "unix:/nowhere/w-{id}.sock", "m", 1.0, 1.0)
    return WorkerCore(WorkerId("0"), settings, link=link, overlapping_steps=overlapping_steps)  # type: ignore[arg-type]


def load(plan: bytes, deadline: float = 0.0) -> LoadSpec:
    return LoadSpec("r", plan, b"sig", [1, 2], sync=True, deadline=deadline)


def store(plan: bytes) -> StoreSpec:
    return StoreSpec(plan, b"sig", [3], ["r"])


def test_a_call_is_waited_for_until_its_plans_deadline_plus_the_margin():
    link = FakeLink()
    worker = core(link)
    worker.start_loads([load(b"l1", deadline=time.monotonic() + 40), load(b"l2")])
    (_, timeout), (_, fallback) = link.sent
    assert 40 < timeout <= 40 + ANSWER_MARGIN_S, "deadline-based, not a fixed 30 s"
    assert fallback == pytest.approx(NO_DEADLINE_WAIT_S, abs=1), "a plan without a deadline keeps the old wait"


@pytest.mark.parametrize("overlapping,dropped_steps", [(1, 1), (2, 2)])
def test_a_failed_synchronous_load_drops_the_stores_of_its_step_and_the_overlapping_ones(overlapping, dropped_steps):
    """Issue 17 window 7: the step's forward computed its blocks over pages that were never
    loaded (with asynchronous scheduling, the next step's forward too)."""
    link = FakeLink(failing={b"bad"})
    worker = core(link, overlapping)
    worker.start_loads([load(b"bad")])
    assert worker.take_load_errors() == {1, 2}
    for step in range(3):
        if step:
            worker.start_loads([])
        worker.start_stores([store(f"s{step}".encode())])
    sent = [plan for plan, _ in link.sent if plan.startswith(b"s")]
    assert sent == [f"s{step}".encode() for step in range(dropped_steps, 3)]


def test_stores_after_successful_loads_are_sent():
    link = FakeLink()
    worker = core(link)
    worker.start_loads([load(b"ok")])
    worker.start_stores([store(b"s")])
    assert [plan for plan, _ in link.sent] == [b"ok", b"s"]


# ---------------------------------------------------------------------------- held stores' reports
def held(plan: bytes, store_id: int) -> StoreSpec:
    return StoreSpec(plan, b"sig", [3], ["r"], store_id=store_id)


class SlowLink(FakeLink):
    """Answers stores only when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[Future] = []

    def submit(self, plan, signature, blocks, timeout=None, layer_groups=0, gpu=None):
        self.sent.append((plan, timeout))
        future: Future = Future()
        self.pending.append(future)
        return future


def test_a_held_store_is_reported_settled_once_it_is_done_not_before():
    link = SlowLink()
    w = core(link)
    w.start_stores([held(b"s", 5), StoreSpec(b"t", b"sig", [4], ["r"])])
    w.finished()
    assert w.settled_stores() == [], "still in flight"
    for f in link.pending:
        f.set_result("ok")
    w.finished()
    assert w.settled_stores() == [5], "only held stores are reported"
    assert w.settled_stores() == []


def test_held_stores_a_failed_load_dropped_are_reported_settled_at_once():
    link = FakeLink(failing={b"bad"})
    w = core(link)
    w.start_loads([load(b"bad")])
    w.start_stores([held(b"s", 7)])
    assert b"s" not in [plan for plan, _ in link.sent]
    assert w.settled_stores() == [7]


def test_a_failed_held_store_is_settled_too():
    link = FakeLink(failing={b"s"})
    w = core(link)
    w.start_stores([held(b"s", 9)])
    w.fence()
    assert w.settled_stores() == [9]
