"""The worker's copy lanes: bounded admission, the deadline checked when a lane starts a job."""
from __future__ import annotations

import asyncio
import threading

import pytest

from kvbm_worker.lanes import Lane, LaneFull, Lanes, LateStart


def test_admission_is_bounded_per_lane_and_released():
    lanes = Lanes(max_queued=2)
    a, b = lanes.admit(Lane.LOAD, "a"), lanes.admit(Lane.LOAD, "b")
    with pytest.raises(LaneFull, match="DYN_KVBM_MAX_QUEUED_JOBS"):
        lanes.admit(Lane.LOAD, "c")
    lanes.admit(Lane.STORE, "s")  # the other lane has its own bound
    a.release()
    a.release()  # idempotent
    assert lanes.admitted(Lane.LOAD) == 1
    lanes.admit(Lane.LOAD, "c")
    b.release()
    lanes.close()


def test_a_job_whose_deadline_passed_in_the_queue_never_starts():
    now = [0.0]
    lanes = Lanes(max_queued=8, clock=lambda: now[0])
    gate = threading.Event()
    ran: list[str] = []

    def blocker() -> str:
        gate.wait(10)
        now[0] = 5.0  # time passes while the next job waits for the lane
        return "blocker"

    async def scenario():
        first = asyncio.ensure_future(lanes.run(lanes.admit(Lane.LOAD, "first"), 1.0, blocker))
        second = asyncio.ensure_future(lanes.run(lanes.admit(Lane.LOAD, "second"), 2.0, ran.append, "second"))
        await asyncio.sleep(0.05)
        gate.set()
        result, seconds = await first
        with pytest.raises(LateStart) as info:
            await second
        await lanes.drain()
        return result, info.value

    result, late = asyncio.run(scenario())
    assert result == "blocker" and ran == [], "a job started after its deadline"
    assert late.late_by == pytest.approx(3.0) and lanes.late_starts == 1
    assert lanes.admitted(Lane.LOAD) == 0
    lanes.close()
