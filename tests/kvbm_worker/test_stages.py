"""The staging area's bookkeeping (``kvbm_worker/stages.py``, pure): one staged load at a time,
held while its copies are being issued, while a call that took it copies from it, and otherwise
for its hold; taken once, only by its own plan and region within the hold."""
from __future__ import annotations

import asyncio

import pytest

from kvbm_client.ids import JobId
from kvbm_worker.jobs import JobKey
from kvbm_worker.stages import MAX_STAGED_GROUPS, StageArea, StageLayout

LAYOUT = StageLayout(4, (2, 3, 4), 1, 100)
A, B = JobKey("L", 1, JobId(1)), JobKey("L", 1, JobId(2))


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def staged(area: StageArea, job: JobKey, now: float, loop, done: bool = True):
    load = area.claim(job, "r", LAYOUT, now, deadline=100.0)
    assert load is not None
    load.task = loop.create_future()
    if done:
        load.task.set_result(100.0)
    return load


def test_one_staged_load_at_a_time_until_its_hold_passes(loop):
    area = StageArea(hold_s=1.0)
    staged(area, A, 0.0, loop)
    assert area.claim(B, "r", LAYOUT, 0.5, 100.0) is None
    assert area.claim(B, "r", LAYOUT, 1.0, 100.0) is not None, "A's hold passed: the area is free"
    assert area.take(A, "r", 1.1) is None, "A was replaced"


def test_the_hold_ends_at_the_plans_deadline_if_that_comes_first(loop):
    area = StageArea(hold_s=1.0)
    load = area.claim(A, "r", LAYOUT, 0.0, deadline=0.25)
    assert load is not None and load.hold_until == 0.25


def test_a_stage_still_issuing_its_copies_holds_the_area_past_its_hold(loop):
    """A slow go: its copies must not land in the area after a newer stage's."""
    area = StageArea(hold_s=1.0)
    load = staged(area, A, 0.0, loop, done=False)
    assert area.claim(B, "r", LAYOUT, 5.0, 100.0) is None
    load.task.set_result(100.0)
    assert area.claim(B, "r", LAYOUT, 5.0, 100.0) is not None


def test_a_taken_load_holds_the_area_until_released(loop):
    area = StageArea(hold_s=1.0)
    load = staged(area, A, 0.0, loop)
    assert area.take(A, "r", 0.1) is load
    assert area.take(A, "r", 0.1) is None, "taken once"
    assert area.claim(B, "r", LAYOUT, 5.0, 100.0) is None, "its copies from the area may still run"
    area.release(load)
    assert area.claim(B, "r", LAYOUT, 5.0, 100.0) is not None


@pytest.mark.parametrize("job,region,now", [(B, "r", 0.1), (A, "other", 0.1), (A, "r", 1.0)])
def test_only_its_plan_and_region_take_it_within_its_hold(loop, job, region, now):
    area = StageArea(hold_s=1.0)
    load = staged(area, A, 0.0, loop)
    assert area.take(job, region, now) is None
    assert area.current is load and not load.taken


def test_releasing_a_load_that_no_longer_holds_the_area_changes_nothing(loop):
    area = StageArea(hold_s=1.0)
    old = staged(area, A, 0.0, loop)
    new = staged(area, B, 2.0, loop)
    area.release(old)
    assert area.current is new


def test_stage_layouts_fit_the_leading_groups_the_area_holds():
    assert StageLayout.fit(10, [4, 6, 7, 8], 100, 10 * 4 * 100 - 1) is None
    first = StageLayout.fit(10, [4, 6, 7, 8], 100, 1 << 20)
    assert first is not None and first.staged == 1 == MAX_STAGED_GROUPS and first.nbytes == 4000, \
        "the first group only, however large the area"
    small = StageLayout.fit(10, [4, 6, 7, 8], 100, 10 * 6 * 100, max_groups=4)
    assert small is not None and small.staged == 2 and small.nbytes == 6000
    assert small.pages(1) == (4, 6) and small.group_offset(1) == 4000 and small.group_bytes(1) == 200
    assert small.block_offsets(1).tolist() == [4000 + 200 * i for i in range(10)]
    assert small.group_of((4, 6)) == 1 and small.group_of((6, 7)) is None
    whole = StageLayout.fit(10, [4, 6, 7, 8], 100, 1 << 20, max_groups=4)
    assert whole is not None and whole.staged == 4 and whole.nbytes == 8000
