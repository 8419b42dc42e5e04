"""Transfer jobs in flight: who must confirm them and by when.

Runs in the leader; pure and synchronous (the caller passes the clock). A job is settled
once every expected worker confirmed it (commit), any worker reported a failure, the owning
session released it, or it expired (roll back).

NOTE: a rolled-back job's slots stay reserved until ``expires`` (deadline + grace): a worker
may have started the copy just before the deadline, and a slot handed to another block while
that copy still writes it would serve wrong bytes. Workers refuse to start after ``deadline``.

A worker moves no byte of a job before :meth:`JobTable.start` said yes (``StartTransfer``):
so a plan replayed after its job was released, expired or settled is refused, and a job
that a worker started is never rolled back before that worker reported or the job expired.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator

from kvbm_client.ids import JobId, SessionId, WorkerId

from .decisions import JobPlacement


class JobState(enum.Enum):
    PENDING = "pending"
    CONFIRMED = "confirmed"  # every expected worker reported success
    FAILED = "failed"  # a worker failed, the session gave up, or the deadline passed


@dataclass(slots=True)
class Job:
    """One job: its placement, its owner, its clock, and what the workers said so far."""

    placement: JobPlacement
    session: SessionId | None
    deadline: float
    expires: float
    expected: frozenset[WorkerId]
    reported: set[WorkerId] = field(default_factory=set)
    started: set[WorkerId] = field(default_factory=set)  # workers told to go (StartTransfer)
    failed: bool = False
    error: str = ""

    @property
    def job_id(self) -> JobId:
        return self.placement.job_id

    @property
    def state(self) -> JobState:
        if self.failed:
            return JobState.FAILED
        if self.expected <= self.reported:
            return JobState.CONFIRMED
        return JobState.PENDING

    @property
    def all_reported(self) -> bool:
        return self.expected <= self.reported

    @property
    def may_be_copying(self) -> bool:
        """A worker was told to start and has not reported: its copy may still run."""
        return bool(self.started - self.reported)


class StartRefused(enum.Enum):
    """Why a worker may not start a job (``StartTransfer``)."""

    NOT_LIVE = "not live (settled, expired, released, or never issued)"
    FAILED = "failed"
    LATE = "past its deadline"
    NOT_EXPECTED = "not addressed to this worker"


class JobTable:
    """Pending jobs by id; ids are never reused within a leader's life."""

    def __init__(self) -> None:
        self._jobs: dict[JobId, Job] = {}
        self._next = 1

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._jobs.values()))

    def next_id(self) -> JobId:
        job_id = JobId(self._next)
        self._next += 1
        return job_id

    def add(self, job: Job) -> None:
        assert job.job_id not in self._jobs
        self._jobs[job.job_id] = job

    def get(self, job_id: JobId) -> Job | None:
        return self._jobs.get(job_id)

    def pop(self, job_id: JobId) -> Job | None:
        return self._jobs.pop(job_id, None)

    def report(self, job_id: JobId, worker: WorkerId, ok: bool, error: str = "") -> Job | None:
        job = self._jobs.get(job_id)
        if job is None:
            return None
        job.reported.add(worker)
        if not ok and not job.failed:
            job.failed, job.error = True, error or f"worker {worker} failed"
        return job

    def start(self, job_id: JobId, worker: WorkerId, now: float) -> Job | StartRefused:
        """Let ``worker`` start copying ``job_id``, or say why not (nothing changes then)."""
        job = self._jobs.get(job_id)
        if job is None:
            return StartRefused.NOT_LIVE
        if worker not in job.expected:
            return StartRefused.NOT_EXPECTED
        if job.failed:
            return StartRefused.FAILED
        if now >= job.deadline:
            return StartRefused.LATE
        job.started.add(worker)
        return job

    def fail(self, job_id: JobId, error: str) -> Job | None:
        job = self._jobs.get(job_id)
        if job is not None and not job.failed:
            job.failed, job.error = True, error
        return job

    def due(self, now: float) -> list[Job]:
        """Jobs past their expiry (to roll back)."""
        return [j for j in self._jobs.values() if now >= j.expires]

    def of_session(self, session: SessionId) -> list[Job]:
        return [j for j in self._jobs.values() if j.session == session]

    def clear(self) -> list[Job]:
        jobs = list(self._jobs.values())
        self._jobs.clear()
        return jobs
