"""What a worker's job runner needs of the leader (:class:`LeaderGate`, implemented by
:class:`~kvbm_worker.leader_link.LeaderLink`) and what it tells it (:class:`JobReport`).

Runs in the worker daemon. The runner asks the leader's go for each new job and reports each
job's outcome to the leader that issued the plan, never to another one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvbm_client.ids import JobId, SlotId

from .jobs import JobKey


@dataclass(frozen=True, slots=True)
class JobReport:
    """A worker's word on one job (``CompleteTransferRequest``)."""

    job_id: JobId
    ok: bool
    error: str = ""
    moved: int = 0
    seconds: float = 0.0
    bad_disk_slots: tuple[SlotId, ...] = ()
    bad_host_slots: tuple[SlotId, ...] = ()


class LeaderGate(Protocol):
    """What the runner needs of the leader link (:class:`kvbm_worker.leader_link.LeaderLink`)."""

    @property
    def plan_key(self) -> bytes | None:
        """The current leader's plan key; None while not attached."""

    @property
    def grace(self) -> float:
        """Seconds the leader keeps a job's slots after its deadline."""

    @property
    def leader_id(self) -> str:
        """The current leader's id ("" while not attached)."""

    async def start_job(self, job: JobKey) -> float:
        """The leader's go for a new job: its deadline; raises :class:`JobFailed` if not live
        (or if the job is another leader's)."""

    async def report(self, report: JobReport) -> bool:
        """Send a report; whether the leader accepted it."""
