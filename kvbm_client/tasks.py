"""Background tasks held until they end: :class:`TaskSet`.

Runs in any role, on its event loop. The loop keeps only a weak reference to a task, so a task
nobody holds may be garbage-collected mid-run; a :class:`TaskSet` holds each task it spawned
until the task is done, then drops it (in the task's done callback). Invariants:

* a task is in the set from :meth:`TaskSet.spawn` until it is done, never after;
* a task that raised (not a cancelled one) is logged once, at ERROR with its traceback, on the
  owner's logger, and its exception goes no further: the done callback retrieves it, so asyncio
  does not report it again ("Task exception was never retrieved"), and the owner never sees it;
* :meth:`TaskSet.close` cancels every task left, tasks spawned while it waits included, and
  returns once all of them are done; it raises none of their exceptions (those were logged).

Used by both daemons (the leader's rebalancer, request planner and gRPC commands; the worker's
job runner and region socket); it imports nothing of kvbm, so any module may import it.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


class TaskSet:
    """Background tasks of one owner (see the module docstring).

    Args:
        log: the owner's logger (a failed task is logged there).
        what: what the tasks are, for that log line ("rebalancer command").
    """

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log = log
        self.what = what
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run ``coro`` as a task on the running loop, held until done; ``name`` names the
        task (and the log line, should it fail)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # (retrieved: asyncio reports it no more)
        if exc is not None:
            self.log.error("%s %s failed: %r", self.what, task.get_name(), exc, exc_info=exc)

    def __len__(self) -> int:
        return len(self._tasks)

    def cancel_all(self) -> int:
        """Cancel every task held (they end later, see :meth:`close`); how many."""
        for task in self._tasks:
            task.cancel()
        return len(self._tasks)

    async def close(self) -> None:
        """Cancel every task held and wait until all are done (also those spawned meanwhile)."""
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
