"""``TaskSet``: a background task is held until done then dropped, its exception is logged once
and goes no further, ``close`` cancels what is left and waits for it."""
from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from typing import Any

import pytest

from kvbm_client.tasks import TaskSet

LOG = logging.getLogger("kvbm.test.tasks")


def run(scenario: Any) -> list[dict[str, Any]]:
    """Run ``scenario`` on a fresh loop; what reached the loop's exception handler."""
    reported: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
        await scenario()
        gc.collect()  # a dropped task whose exception nobody retrieved would be reported now

    asyncio.run(main())
    return reported


def records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOG.name]


def test_a_task_is_held_until_done_then_dropped() -> None:
    async def scenario() -> None:
        tasks = TaskSet(LOG, "test")
        go = asyncio.Event()

        async def work() -> int:
            await go.wait()
            return 7

        task = tasks.spawn(work(), "held")
        assert task.get_name() == "held"
        ref = weakref.ref(task)
        del task
        gc.collect()  # the loop alone holds a task weakly: only the set keeps it alive
        await asyncio.sleep(0)
        assert len(tasks) == 1
        held = ref()
        assert held is not None and not held.done()
        go.set()
        assert await held == 7
        assert len(tasks) == 0

    assert run(scenario) == []


def test_an_exception_is_logged_once_and_goes_no_further(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        tasks = TaskSet(LOG, "job report")

        async def fail() -> None:
            raise ValueError("boom")

        tasks.spawn(fail(), "job 3")
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(tasks) == 0
        await tasks.close()  # nothing left; raises nothing

    with caplog.at_level(logging.ERROR, logger=LOG.name):
        reported = run(scenario)
    assert reported == []  # retrieved: no "Task exception was never retrieved"
    (record,) = records(caplog)
    assert record.levelno == logging.ERROR
    assert record.getMessage() == "job report job 3 failed: ValueError('boom')"
    assert record.exc_info is not None and isinstance(record.exc_info[1], ValueError)


def test_a_cancelled_task_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        tasks = TaskSet(LOG, "test")
        task = tasks.spawn(asyncio.sleep(60))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(tasks) == 0

    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        assert run(scenario) == []
    assert records(caplog) == []


def test_close_cancels_pending_tasks_and_awaits_them(caplog: pytest.LogCaptureFixture) -> None:
    cleaned: list[str] = []

    async def scenario() -> None:
        tasks = TaskSet(LOG, "test")

        async def pending(name: str) -> None:
            try:
                await asyncio.sleep(60)
            finally:
                await asyncio.sleep(0.01)  # a cleanup that takes turns of the loop: close waits for it
                cleaned.append(name)

        async def spawns_on_cancel() -> None:
            try:
                await asyncio.sleep(60)
            finally:  # a task spawned while close waits is cancelled and awaited too
                tasks.spawn(pending("late"), "late")

        async def fails_on_cancel() -> None:
            try:
                await asyncio.sleep(60)
            finally:
                raise RuntimeError("cleanup failed")  # logged; close raises nothing

        spawned = [tasks.spawn(pending("a")), tasks.spawn(pending("b")), tasks.spawn(spawns_on_cancel()),
                   tasks.spawn(fails_on_cancel(), "failing")]
        await asyncio.sleep(0)
        assert len(tasks) == 4
        await tasks.close()
        assert len(tasks) == 0
        assert all(t.done() for t in spawned)
        assert [t.cancelled() for t in spawned] == [True, True, True, False]
        await tasks.close()  # idempotent

    with caplog.at_level(logging.ERROR, logger=LOG.name):
        assert run(scenario) == []
    assert sorted(cleaned) == ["a", "b", "late"]
    assert [r.getMessage() for r in records(caplog)] == ["test failing failed: RuntimeError('cleanup failed')"]


def test_cancel_all_cancels_without_waiting() -> None:
    async def scenario() -> None:
        tasks = TaskSet(LOG, "test")
        spawned = [tasks.spawn(asyncio.sleep(60)) for _ in range(3)]
        await asyncio.sleep(0)
        assert tasks.cancel_all() == 3
        assert len(tasks) == 3  # still held: they end on their next turn
        await asyncio.gather(*spawned, return_exceptions=True)
        assert len(tasks) == 0 and all(t.cancelled() for t in spawned)

    assert run(scenario) == []
