"""The worker's two copy lanes: one thread for stores (and demotions, promotions), one for
loads, so offload and onboard overlap and the event loop never copies.

Runs in the worker daemon. Owns the lane threads and the admission count of each lane.

Protocol (per job, on the event loop):

    ticket = lanes.admit(lane, label)             # or LaneFull: RESOURCE_EXHAUSTED, nothing queued
    result, seconds = await lanes.run(ticket, deadline, fn, *args)   # consumes the ticket
    ticket.release()                              # only when the job ends before run()

Invariants: at most ``max_queued`` jobs are admitted per lane (waiting for the leader's go,
queued behind the lane, or copying); a job whose deadline passed while it waited is refused
*on the lane*, right before its first byte would move (:class:`LateStart`), so a queued job
never starts late; ``drain()`` returns once no copy is queued or running.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, TypeVar

log = logging.getLogger("kvbm.worker")
T = TypeVar("T")


class Lane(enum.Enum):
    STORE = "store"  # engine -> G2/G3, G2 -> G3 demotions, G3 -> G2 promotions
    LOAD = "load"  # G2/G3 -> engine


class LaneFull(Exception):
    """The lane already holds ``max_queued`` jobs."""


class LateStart(Exception):
    """The job's deadline passed while it waited for its lane; nothing moved."""

    def __init__(self, late_by: float, waited: float) -> None:
        super().__init__(f"past its deadline by {late_by * 1e3:.1f} ms when its lane was free "
                         f"(it waited {waited * 1e3:.1f} ms)")
        self.late_by, self.waited = late_by, waited


@dataclass(slots=True)
class Ticket:
    """One admitted job's place in a lane; released exactly once."""

    lane: Lane
    label: str  # "job 12 load", for the log
    _release: Callable[["Ticket"], None]
    admitted: float = field(default_factory=time.monotonic)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release(self)


class Lanes:
    """See the module docstring. ``clock`` is CLOCK_MONOTONIC (injectable for tests)."""

    def __init__(self, max_queued: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_queued = max_queued
        self._clock = clock
        self._threads = {lane: ThreadPoolExecutor(1, thread_name_prefix=f"kvbm-{lane.value}") for lane in Lane}
        self._admitted = {lane: 0 for lane in Lane}
        self._running = 0
        self._idle = asyncio.Condition()
        self.late_starts = 0

    def admitted(self, lane: Lane) -> int:
        return self._admitted[lane]

    def admit(self, lane: Lane, label: str) -> Ticket:
        """A place in ``lane``, or :class:`LaneFull` (nothing changes then)."""
        if self._admitted[lane] >= self.max_queued:
            raise LaneFull(f"the {lane.value} lane holds {self._admitted[lane]} jobs "
                           f"(DYN_KVBM_MAX_QUEUED_JOBS={self.max_queued})")
        self._admitted[lane] += 1
        return Ticket(lane, label, self._free, self._clock())

    def _free(self, ticket: Ticket) -> None:
        self._admitted[ticket.lane] -= 1

    async def run(self, ticket: Ticket, deadline: float, fn: Callable[..., T], *args: object) -> tuple[T, float]:
        """Run ``fn(*args)`` on the ticket's lane if it starts before ``deadline``; returns its
        result and its seconds on the lane. Raises :class:`LateStart`, or what ``fn`` raised."""
        loop = asyncio.get_running_loop()
        self._running += 1
        try:
            return await loop.run_in_executor(self._threads[ticket.lane], self._on_lane, ticket, deadline, fn, args)
        finally:
            ticket.release()
            self._running -= 1
            async with self._idle:
                self._idle.notify_all()

    def _on_lane(self, ticket: Ticket, deadline: float, fn: Callable[..., T], args: tuple[object, ...]
                 ) -> tuple[T, float]:
        now = self._clock()
        if now >= deadline:
            self.late_starts += 1
            raise LateStart(now - deadline, now - ticket.admitted)
        log.debug("%s: copy starts %.6f ms before its deadline (queued %.1f ms on the %s lane)", ticket.label,
                  (deadline - now) * 1e3, (now - ticket.admitted) * 1e3, ticket.lane.value)
        start = time.perf_counter()
        result = fn(*args)
        return result, time.perf_counter() - start

    async def on_each(self, fn: Callable[[Lane], None]) -> None:
        """Call ``fn(lane)`` once on each lane's thread (first-use costs paid before any job)."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(pool, fn, lane) for lane, pool in self._threads.items()))

    async def drain(self) -> None:
        """Wait until no copy is queued on a lane or running (before pools or a region go away)."""
        async with self._idle:
            await self._idle.wait_for(lambda: self._running == 0)

    def close(self) -> None:
        """Stop the lane threads (after :meth:`drain`); idempotent."""
        for pool in self._threads.values():
            pool.shutdown(wait=True)
