"""Transfer jobs of one worker, in flight and recently done, keyed by the plan that made them.

A job runs once: a second ``Transfer`` of the same signed plan joins the first and gets its
outcome (the vLLM scheduler role starts a load as soon as the engine allocated its blocks,
and the worker role asks for the same plan again before the step's forward). Records are
kept until the plan's deadline, after which no new job could start from that plan anyway.

A load may run in layer groups (``TransferRequest.layer_groups``): its :class:`Landed` counts
the pages of every block that are in the engine's memory, advanced on the event loop as the
lane sees each group arrive; ``TransferLayers`` calls stream it. Invariant: ``Landed.pages``
only grows, and never past ``pages_per_block``.

Pure bookkeeping (no I/O): the job runner (:mod:`kvbm_worker.runner`) owns the tasks.
"""
from __future__ import annotations

import asyncio
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvbm_client.ids import JobId

from .id_arrays import EngineBlocks

if TYPE_CHECKING:
    from .signals import JobSignals

LIMIT = 1024  # records kept at most (done ones are dropped oldest first beyond it)


@dataclass(frozen=True, slots=True)
class JobKey:
    """A plan's identity: job ids restart with a leader and belong to one pool epoch."""

    leader_id: str
    epoch: int
    job_id: JobId


@dataclass(frozen=True, slots=True)
class Moved:
    """What a finished job moved: bytes, and seconds on its lane."""

    bytes: int
    seconds: float


RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # (Linux: this thread alone)


@dataclass(frozen=True, slots=True)
class ThreadUsage:
    """What the calling thread has used: CPU seconds (``thread_time``, exact), of them in the
    kernel (``getrusage(RUSAGE_THREAD)``: apportioned by the scheduler's tick samples, so only a
    load's sum means anything, not a piece's), minor page faults and involuntary context switches
    (counted exactly). ``since`` gives a span's share."""

    cpu: float
    sys: float
    faults: int
    preempted: int

    @staticmethod
    def now() -> "ThreadUsage":
        r = resource.getrusage(RUSAGE_THREAD)
        return ThreadUsage(time.thread_time(), r.ru_stime, r.ru_minflt, r.ru_nivcsw)

    def since(self, start: "ThreadUsage") -> "ThreadUsage":
        return ThreadUsage(self.cpu - start.cpu, self.sys - start.sys, self.faults - start.faults,
                           self.preempted - start.preempted)


@dataclass(frozen=True, slots=True)
class PieceTimes:
    """One piece of a layer-grouped load, for the job's debug line: perf_counter times on the
    lane when its issue began, when it was issued and when the lane saw it landed; ``gpu_ms``:
    when it landed by the GPU's clock, ms after a mark the medium recorded right before the
    first piece was issued (None where the medium has no such clock); ``usage``: what the lane
    thread used while it issued the piece (CPU time much less than ``issued - began``: the
    thread waited, for the interpreter lock or a CPU)."""

    began: float
    issued: float
    landed: float
    gpu_ms: float | None = None
    usage: ThreadUsage | None = None


@dataclass(slots=True)
class Landed:
    """How many leading pages of every block of a load are in the engine's memory (on the
    event loop; see the module docstring). ``waiter()`` is set at the next advance."""

    pages_per_block: int
    groups: int = 1
    pages: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: for the job's debug line: ms after ``t0`` (perf_counter, the job's start) at which each
    #: group was seen landed on the lane thread, and at which the event loop took the news
    t0: float = field(default_factory=time.perf_counter)
    lane_ms: list[float] = field(default_factory=list)
    loop_ms: list[float] = field(default_factory=list)
    #: each piece's times, appended on the lane thread while the copy runs
    #: (:class:`~.grouping.Grouping`); read once the job's copy returned
    pieces: list[PieceTimes] = field(default_factory=list)
    #: the engine's signal words this load writes (a region with a signal page)
    signals: JobSignals | None = None

    def advance(self, pages: int, on_lane: float | None = None) -> None:
        if on_lane is not None:
            self.lane_ms.append((on_lane - self.t0) * 1e3)
            self.loop_ms.append((time.perf_counter() - self.t0) * 1e3)
        if pages <= self.pages:
            return
        self.pages = min(pages, self.pages_per_block)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def waiter(self) -> asyncio.Event:
        return self._changed

    def describe(self) -> str:
        """The group and piece times for the job's debug line ("" before any group landed)."""
        if not self.lane_ms:
            return ""
        def ms(t: float) -> float:
            return round((t - self.t0) * 1e3, 1)
        pieces = [(ms(p.began), ms(p.issued), ms(p.landed)) for p in self.pieces]
        line = (f"; groups landed on the lane at {[round(t, 1) for t in self.lane_ms]} ms, on the loop at "
                f"{[round(t, 1) for t in self.loop_ms]} ms after the job started; pieces (issue began, issued, "
                f"landed) at {pieces} ms")
        if self.pieces and all(p.gpu_ms is not None for p in self.pieces):
            first = ms(self.pieces[0].began)  # the GPU's mark was recorded right before this
            line += f"; by the GPU's clock landed at {[round(first + (p.gpu_ms or 0.0), 1) for p in self.pieces]} ms"
        used = [p.usage for p in self.pieces if p.usage is not None]
        if used and len(used) == len(self.pieces):
            line += (f"; the lane's CPU time issuing each piece {[round(u.cpu * 1e3, 2) for u in used]} ms, "
                     f"{sum(u.sys for u in used) * 1e3:.1f} ms of it in the kernel; minor page faults per piece "
                     f"{[u.faults for u in used]}; preempted {sum(u.preempted for u in used)} times")
        return line


@dataclass(slots=True)
class Job:
    key: JobKey
    region_id: str
    engine_blocks: EngineBlocks
    deadline: float  # the plan's, CLOCK_MONOTONIC seconds
    task: "asyncio.Future[Moved]"
    landed: Landed | None = None  # a load run in layer groups

    def same_target(self, region_id: str, engine_blocks: EngineBlocks) -> bool:
        return region_id == self.region_id and np.array_equal(engine_blocks, self.engine_blocks)


class JobTable:
    """The worker's jobs by :class:`JobKey`; invariant: a running job is never dropped."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._jobs: OrderedDict[JobKey, Job] = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, key: JobKey) -> Job | None:
        return self._jobs.get(key)

    def add(self, job: Job, now: float) -> Job:
        self.expire(now)
        self._jobs[job.key] = job
        return job

    def expire(self, now: float) -> None:
        """Drop done jobs past their deadline, then the oldest done ones beyond ``limit``.
        A job still running is never dropped (a joining call must find it)."""
        for key in [k for k, j in self._jobs.items() if j.task.done() and j.deadline <= now]:
            del self._jobs[key]
        if len(self._jobs) >= self.limit:
            for key in [k for k, j in self._jobs.items() if j.task.done()][:len(self._jobs) - self.limit + 1]:
                del self._jobs[key]
