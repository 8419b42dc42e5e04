"""The worker's table of transfer jobs (pure bookkeeping; the futures stand in for job tasks)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvbm_worker.jobs import Job, JobKey, JobTable, PieceTimes


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def job(loop, n: int, deadline: float, done: bool = True) -> Job:
    task = loop.create_future()
    if done:
        task.set_result((0, 0.0))
    return Job(JobKey("leader-a", 1, n), "region-1", np.arange(3), deadline, task)


def test_jobs_are_keyed_by_leader_epoch_and_id(loop):
    table = JobTable()
    j = table.add(job(loop, 7, deadline=100.0), now=0.0)
    assert table.get(JobKey("leader-a", 1, 7)) is j
    assert table.get(JobKey("leader-b", 1, 7)) is None  # a restarted leader reuses job ids
    assert table.get(JobKey("leader-a", 2, 7)) is None  # a new pool epoch too


def test_same_target_compares_region_and_engine_blocks(loop):
    j = job(loop, 1, deadline=10.0)
    assert j.same_target("region-1", np.arange(3))
    assert not j.same_target("region-2", np.arange(3))
    assert not j.same_target("region-1", np.array([0, 1, 5]))


def test_done_jobs_leave_at_their_deadline_running_ones_never(loop):
    table = JobTable()
    table.add(job(loop, 1, deadline=5.0), now=0.0)
    table.add(job(loop, 2, deadline=5.0, done=False), now=0.0)
    table.add(job(loop, 3, deadline=50.0), now=0.0)
    table.expire(now=10.0)
    assert table.get(JobKey("leader-a", 1, 1)) is None
    assert table.get(JobKey("leader-a", 1, 2)) is not None, "a running job must stay joinable"
    assert table.get(JobKey("leader-a", 1, 3)) is not None


def test_the_oldest_done_jobs_go_first_beyond_the_limit(loop):
    table = JobTable(limit=3)
    table.add(job(loop, 1, deadline=99.0, done=False), now=0.0)
    for n in (2, 3, 4, 5):
        table.add(job(loop, n, deadline=99.0), now=0.0)
    assert len(table) == 3
    kept = [n for n in range(1, 6) if table.get(JobKey("leader-a", 1, n)) is not None]
    assert kept == [1, 4, 5]


def test_landed_only_grows_and_wakes_its_waiters():
    import asyncio

    from kvbm_worker.jobs import Landed

    async def main() -> None:
        landed = Landed(8, 4)
        first = landed.waiter()
        landed.advance(2)
        assert first.is_set() and landed.pages == 2
        second = landed.waiter()
        landed.advance(1)  # never backwards
        assert landed.pages == 2 and not second.is_set()
        landed.advance(99)
        assert landed.pages == 8 and second.is_set()
    asyncio.run(main())


def test_landed_keeps_each_groups_lane_and_loop_times_and_the_piece_times_for_the_debug_line():
    import asyncio
    import time

    from kvbm_worker.jobs import Landed

    async def main() -> None:
        landed = Landed(8, 2)
        assert landed.describe() == ""
        landed.advance(4, landed.t0 + 0.010)  # seen on the lane 10 ms after the start
        landed.advance(8, time.perf_counter())
        assert len(landed.lane_ms) == len(landed.loop_ms) == 2
        assert abs(landed.lane_ms[0] - 10.0) < 1e-6
        assert all(lane <= loop for lane, loop in zip(landed.lane_ms[1:], landed.loop_ms[1:]))
        landed.pieces.append(PieceTimes(landed.t0 + 0.001, landed.t0 + 0.002, landed.t0 + 0.010))  # as the lane appends
        line = landed.describe()
        assert "on the lane at [10.0," in line and "on the loop at" in line
        assert "landed) at [(1.0, 2.0, 10.0)] ms" in line and "GPU's clock" not in line
        landed.pieces[0] = PieceTimes(landed.t0 + 0.001, landed.t0 + 0.002, landed.t0 + 0.010, gpu_ms=7.5)
        assert "by the GPU's clock landed at [8.5] ms" in landed.describe(), "the mark was taken at 1.0 ms"
        landed.advance(8)  # an advance without a lane time (a caller's own) records none
        assert len(landed.lane_ms) == 2
    asyncio.run(main())
