"""Loads before stores (kvbm_worker/loads_first.py): the gate's waits with real threads and the
real clock (the mover's use of it: tests/kvbm_worker/test_mover.py)."""
from __future__ import annotations

import threading
import time

import pytest

from kvbm_worker.grouping import DMA_FLOOR_BPS
from kvbm_worker.loads_first import LoadsFirst

FAR = 1e18


def end_load_after(gate: LoadsFirst, seconds: float) -> threading.Thread:
    """A load that runs now and ends ``seconds`` later on another thread."""
    started = threading.Event()

    def run() -> None:
        with gate.loading():
            started.set()
            time.sleep(seconds)
    t = threading.Thread(target=run)
    t.start()
    started.wait(5)
    return t


def test_a_store_goes_at_once_when_no_load_runs():
    gate = LoadsFirst(1.0)
    turn = gate.store()
    t0 = time.monotonic()
    assert turn.before_piece(FAR, 1 << 20) == 0.0 and turn.waits == 0
    assert time.monotonic() - t0 < 0.05
    with gate.loading(on=False):  # a store's own run marks nothing
        assert gate.active == 0 and turn.before_piece(FAR, 1) == 0.0


def test_a_store_waits_until_the_load_ends():
    gate = LoadsFirst(5.0)
    load = end_load_after(gate, 0.15)
    turn = gate.store()
    waited = turn.before_piece(FAR, 1 << 20)
    load.join()
    assert 0.1 <= waited < 2.0, waited
    assert turn.waits == 1 and turn.waited_s == waited and turn.left_s == pytest.approx(5.0 - waited)


def test_two_loads_at_once_are_both_waited_for():
    gate = LoadsFirst(5.0)
    first, second = end_load_after(gate, 0.05), end_load_after(gate, 0.2)
    assert gate.active == 2
    waited = gate.store().before_piece(FAR, 1)
    first.join(), second.join()
    assert waited >= 0.15 and gate.active == 0


def test_a_store_waits_at_most_its_budget_in_all():
    gate = LoadsFirst(0.1)
    with gate.loading():
        turn = gate.store()
        t0 = time.monotonic()
        first = turn.before_piece(FAR, 1)
        assert 0.09 <= first < 1.0
        assert turn.before_piece(FAR, 1) == 0.0, "the budget is spent: later pieces go at once"
        assert time.monotonic() - t0 < 1.0
        assert gate.store().left_s == 0.1, "each job has its own budget"


def test_a_store_never_waits_past_the_time_its_piece_must_go_to_land_by_the_deadline():
    gate = LoadsFirst(5.0)
    nbytes = int(DMA_FLOOR_BPS * 0.5)  # half a second at the floor rate
    with gate.loading():
        turn = gate.store()
        assert turn.before_piece(time.monotonic() + 0.4, nbytes) == 0.0, "already too late to wait"
        waited = turn.before_piece(time.monotonic() + 0.5 + 0.1, nbytes)
        assert 0.05 <= waited < 0.5, waited


def test_no_budget_means_stores_never_wait():
    gate = LoadsFirst(0.0)
    with gate.loading():
        assert gate.store().before_piece(FAR, 1) == 0.0


@pytest.mark.parametrize("bad", [-0.001, 10.001])
def test_a_budget_out_of_bounds_is_refused(bad):
    with pytest.raises(ValueError, match="wait for loads"):
        LoadsFirst(bad)
