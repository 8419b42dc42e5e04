"""Transfer and command jobs of one worker, from a checked plan to the leader's report.

Runs in the worker daemon, on its event loop (copies on the lanes). Decides ``Transfer`` and
``Command`` for every transport; raises :class:`~.errors.PlanRejected` (nothing moved) or
:class:`~.errors.JobFailed` (the job's outcome), which the transports map.

A job, once:

1. :mod:`.plan_check` (signature, epoch, ranges) and, for a new job, its deadline;
2. a place in its lane (:class:`~.lanes.Lanes`, bounded: RESOURCE_EXHAUSTED);
3. the leader's go (``StartTransfer``: a released, expired or settled job stops here), asked
   only of the leader that issued the plan;
4. on the lane, right before the first byte: its deadline again, the pool epoch, and the
   leader (a plan of a leader that has since been replaced moves nothing);
5. the copy (:class:`~.mover.BlockMover`), which stops at the plan's deadline for a transfer
   (the engine's memory is touched by no copy after it: the connector's waits rely on it) and
   at deadline + half the leader's grace for a command (the leader keeps a job's slots until
   deadline + grace);
6. the report to the leader that issued the plan (``CompleteTransfer``, with the slots that
   failed verification); a job of a previous leader is never reported (its job id may name
   another job of the new leader) and fails instead.

Status codes of ``Transfer``: UNAVAILABLE only while this daemon shuts down (engines read it
as "the daemon and its regions are gone"); a job that fails because the leader is away or
did not confirm it is ABORTED (the daemon still holds the engine's region). The ``Transfer``
and ``TransferLayers`` calls, which start or join a job, are :mod:`.transfer_calls`'s.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from kvbm_client.contract import pb
from kvbm_client.ids import JobId, PlanKind, Tier, WorkerId
from kvbm_client.security import NodeKey, sign_ack
from kvbm_client.tasks import TaskSet

from .allocation import PoolAllocator
from .errors import CopyExpired, CopyFailed, JobFailed, PlanRejected, Refusal, SlotsFailed
from .handlers.disk_guard import DiskHung
from .jobs import JobTable, Landed, Moved
from .lanes import LaneFull, Lanes, LateStart, Ticket
from .leader_gate import JobReport, LeaderGate
from .grouping import Grouping
from .mover import BlockMover
from .plan_check import Batch, check_command, check_not_late
from .region_registry import RegionRegistry
from .regions import EngineRegion
from .stages import StageArea, StagedLoad, StageLayout
from .transfer_calls import TransferCalls

log = logging.getLogger("kvbm.worker")
Code = grpc.StatusCode
#: NOTE: a copy stops at deadline + GRACE_SHARE x the leader's grace: the leader keeps a job's
#: slots until deadline + grace, and a copy must not outlive that (the rest is margin).
GRACE_SHARE = 0.5


@dataclass
class Counters:
    """The worker's counters (``WorkerStatusResponse.counters``)."""

    values: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("bytes_stored", "bytes_loaded", "bytes_demoted", "bytes_promoted", "jobs_ok", "jobs_failed", "jobs_joined",
         "jobs_late", "jobs_expired", "jobs_refused_busy", "corrupt_disk_slots", "corrupt_host_slots", "loads_staged",
         "staged_loads_used"), 0.0))

    def add(self, name: str, amount: float = 1) -> None:
        self.values[name] += amount


class JobRunner(TransferCalls):
    """Runs the jobs of one worker (see the module docstring). Owns the job table and the
    counters; borrows the lanes, the region registry, the pools and the leader gate."""

    def __init__(self, worker_id: WorkerId, lanes: Lanes, regions: RegionRegistry, pools: PoolAllocator,
                 gate: LeaderGate, node_key: NodeKey) -> None:
        self.worker_id = worker_id
        self.lanes, self.regions, self.pools, self.gate = lanes, regions, pools, gate
        self.node_key = node_key
        self.counters = Counters()
        self.closing = False
        self._jobs = JobTable()
        self.stages = StageArea()  # the load staged before its blocks exist (:mod:`.stages`)
        self._reports = TaskSet(log, "report")  # of loads, sent beside their answers

    def _guard(self) -> None:
        if self.closing:
            raise PlanRejected(Code.UNAVAILABLE, "worker is shutting down")

    def _admit(self, batch: Batch) -> Ticket:
        try:
            return self.lanes.admit(batch.lane, f"job {batch.job_id} {batch.kind.name.lower()}")
        except LaneFull as exc:
            self.counters.add("jobs_refused_busy")
            raise PlanRejected(Code.RESOURCE_EXHAUSTED, f"job {batch.job_id}: {exc}", batch.job_id) from None

    # ------------------------------------------------------------------ Transfer (the calls: .transfer_calls)
    async def _run_job(self, batch: Batch, region: EngineRegion, ticket: Ticket, landed: Landed | None = None,
                       staged: StagedLoad | None = None) -> Moved:
        """One transfer, whoever asked for it and whether or not they still wait. Raises
        :class:`JobFailed` with the status to answer. ``staged``: the load's stage, taken."""
        try:
            with region.use():  # the region is not closed under this copy (else NOT_FOUND)
                moved = await self._copy(batch, region, ticket, landed, staged)
        except CopyFailed as exc:
            self.counters.add("jobs_failed")
            if self._of_current_leader(batch):
                await self.gate.report(JobReport(batch.job_id, False, exc.message,
                                                 bad_disk_slots=tuple(exc.bad.get(Tier.DISK, ())),
                                                 bad_host_slots=tuple(exc.bad.get(Tier.HOST, ()))))
            raise
        except JobFailed:
            ticket.release()  # idempotent: a job refused before its copy (its region unregistered)
            self.counters.add("jobs_failed")
            raise
        if not self._of_current_leader(batch):
            self.counters.add("jobs_failed")
            raise JobFailed(Code.ABORTED, f"job {batch.job_id} belongs to leader {batch.job.leader_id}, which has "
                                          "been replaced; not reported (the new leader's job of that id is another)")
        store = batch.kind is PlanKind.STORE
        self.counters.add("bytes_stored" if store else "bytes_loaded", moved.bytes)
        self.counters.add("jobs_ok")
        if log.isEnabledFor(logging.DEBUG):  # (the group times are formatted only for this line)
            log.debug("job %d %s: %d blocks, %d bytes in %.2f ms%s", batch.job_id, batch.kind.name.lower(),
                      len(batch.engine_blocks), moved.bytes, moved.seconds * 1e3,
                      landed.describe() if landed is not None else "")
        report = JobReport(batch.job_id, True, "", moved.bytes, moved.seconds)
        if not store:
            # The bytes are in the engine's memory: answer now and confirm to the leader beside
            # it (its only effect is to unpin the slots, which a lost report does at the deadline).
            self._reports.spawn(self.gate.report(report), f"job {batch.job_id}")
            return moved
        if not await self.gate.report(report):
            raise JobFailed(Code.ABORTED, f"job {batch.job_id}: bytes stored but the leader did not confirm them")
        return moved

    async def _copy(self, batch: Batch, region: EngineRegion | None, ticket: Ticket,
                    landed: Landed | None = None, staged: StagedLoad | None = None) -> Moved:
        """Steps 3 to 5 of the module docstring (a staged load's go is its stage's). Raises
        :class:`JobFailed` when the leader says no (nothing moved, nothing to report),
        :class:`CopyFailed` when the copy failed."""
        try:
            return await self._go_and_copy(batch, region, ticket, landed, staged)
        finally:
            if staged is not None:
                self.stages.release(staged)  # (its copies from the area are done, or were never issued)

    async def _go_and_copy(self, batch: Batch, region: EngineRegion | None, ticket: Ticket,
                           landed: Landed | None, staged: StagedLoad | None) -> Moved:
        go = await self._staged_go(batch, staged)
        grouping = self._landed_from_lane(landed)
        layout = staged.layout if staged is not None and go is not None else None
        if layout is not None and (grouping is None or list(layout.bounds) != grouping.bounds):
            log.debug("job %d load: staged in other layer groups; copying every group", batch.job_id)
            layout = None
        if layout is not None:
            self.counters.add("staged_loads_used")
        try:
            self._check_leader(batch)
            deadline = go if go is not None else await self._ask_go(batch)
        except JobFailed as exc:
            ticket.release()
            log.warning("%s", exc.message)
            raise
        until = deadline if batch.kind in (PlanKind.LOAD, PlanKind.STORE) else deadline + GRACE_SHARE * self.gate.grace
        try:
            nbytes, seconds = await self.lanes.run(ticket, deadline, self._on_lane, batch, region, until,
                                                   grouping, layout)
        except Exception as exc:
            raise self._failure(batch, exc) from None
        return Moved(nbytes, seconds)

    async def _staged_go(self, batch: Batch, staged: StagedLoad | None) -> float | None:
        """The go of ``staged``'s stage once its copies were issued; None if there is none (no
        stage, or it failed: the job asks its own go and copies every group)."""
        if staged is None or staged.task is None:
            return None
        try:
            go = await asyncio.shield(staged.task)
        except Exception as exc:  # (its own call answered it)
            log.debug("job %d load: its stage failed (%s); copying every group", batch.job_id, exc)
            return None
        return go

    async def _run_stage(self, batch: Batch, region: EngineRegion, ticket: Ticket, load: StagedLoad) -> float:
        """A stage (:mod:`.stages`): its copies issued on the load lane at once, the leader's go
        asked beside them; returns the go's deadline once both are done (the staged bytes are
        used only then). The area is freed when either fails, after the copies were issued."""
        try:
            try:
                self._check_leader(batch)
            except JobFailed:
                ticket.release()
                raise
            copies, go = await asyncio.gather(
                self.lanes.run(ticket, batch.deadline, self._stage_on_lane, batch, region, batch.deadline, load.layout),
                self._stage_go(batch), return_exceptions=True)
            if isinstance(copies, BaseException):
                if not isinstance(copies, Exception):
                    raise copies
                raise self._failure(batch, copies) from None
            if isinstance(go, BaseException):
                raise go
            self.counters.add("loads_staged")
            return go
        except BaseException:
            self.stages.release(load)
            raise

    async def _stage_go(self, batch: Batch) -> float:
        """:meth:`_ask_go` for a stage's job, asked while its copies run (a refusal logged)."""
        try:
            return await self._ask_go(batch)
        except JobFailed as exc:
            log.debug("job %d load: not staged, %s", batch.job_id, exc.message)
            raise

    async def _ask_go(self, batch: Batch) -> float:
        """Step 3: the leader's go for ``batch``'s job, the deadline it may run by. Raises
        :class:`JobFailed` when the leader says no; ABORTED when it is away (this daemon and the
        region are not)."""
        try:
            deadline = min(batch.deadline, await self.gate.start_job(batch.job))
            self._check_leader(batch)  # the go came from the leader that issued the plan
        except JobFailed as exc:
            if exc.code is Code.UNAVAILABLE:
                raise JobFailed(Code.ABORTED, exc.message) from None
            raise
        return deadline

    def _stage_on_lane(self, batch: Batch, region: EngineRegion, until: float, layout: StageLayout) -> None:
        self._lane_mover(batch).stage(batch, region, until, layout)

    def _of_current_leader(self, batch: Batch) -> bool:
        """NOTE: read on the event loop, where a new leader's welcome is handled: a report sent
        right after this check goes to the plan's leader, or to a new one that has no job yet
        (its jobs exist only after this worker's PoolsReady, sent after the welcome)."""
        return batch.job.leader_id == self.gate.leader_id

    def _check_leader(self, batch: Batch) -> None:
        if not self._of_current_leader(batch):
            raise JobFailed(Code.FAILED_PRECONDITION, f"job {batch.job_id}: its leader {batch.job.leader_id} has "
                                                      "been replaced; nothing moved")

    def _landed_from_lane(self, landed: Landed | None) -> Grouping | None:
        """What the mover needs to run a load in ``landed``'s groups (their bounds as the data
        path's pacing shapes them), reporting each group's pages to the event loop (the lane
        thread only appends to ``landed.pieces``)."""
        if landed is None:
            return None
        loop = asyncio.get_running_loop()
        return Grouping(self.pools.path.pacing.bounds(landed.pages_per_block, landed.groups),
                        lambda pages: loop.call_soon_threadsafe(landed.advance, pages, time.perf_counter()),
                        landed.pieces, landed.signals)

    def _on_lane(self, batch: Batch, region: EngineRegion | None, until: float,
                 grouping: Grouping | None = None, staged: StageLayout | None = None) -> int:
        return self._lane_mover(batch).run(batch, region, until, grouping, staged)

    def _lane_mover(self, batch: Batch) -> BlockMover:
        """On the lane thread, after its deadline check: the pools and the leader must still
        be the plan's (a new leader numbers its epochs and jobs from 1 again)."""
        pools = self.pools.current
        if pools is None or pools.epoch != batch.job.epoch:
            raise Refusal(Code.FAILED_PRECONDITION, f"pools left epoch {batch.job.epoch} while the job was queued")
        if batch.job.leader_id != self.gate.leader_id:
            raise Refusal(Code.FAILED_PRECONDITION, f"leader {batch.job.leader_id} was replaced while the job was "
                                                    "queued")
        return pools.mover

    def _failure(self, batch: Batch, exc: Exception) -> CopyFailed:
        job = f"job {batch.job_id}"
        if isinstance(exc, LateStart):
            self.counters.add("jobs_late")
            log.warning("%s %s: refused, %s", job, batch.kind.name.lower(), exc)
            return CopyFailed(Code.DEADLINE_EXCEEDED, f"{job} is past its deadline: {exc}")
        if isinstance(exc, Refusal):
            return CopyFailed(exc.code, f"{job}: {exc.message}")
        if isinstance(exc, SlotsFailed):
            self.counters.add("corrupt_disk_slots" if exc.tier is Tier.DISK else "corrupt_host_slots", len(exc.slots))
            log.error("%s: %s; the leader drops those copies", job, exc)
            return CopyFailed(Code.DATA_LOSS, f"{job} failed on worker {self.worker_id}: {exc}", {exc.tier: exc.slots})
        if isinstance(exc, CopyExpired):  # W2 of kvbm_client.connectors.core: stopped at its time limit
            self.counters.add("jobs_expired")
            log.error("%s failed: %s", job, exc)
            return CopyFailed(Code.DEADLINE_EXCEEDED, f"{job} failed on worker {self.worker_id}: {exc}")
        if isinstance(exc, DiskHung):
            log.error("%s failed: %s", job, exc)
        else:
            log.error("%s failed", job, exc_info=exc)
        return CopyFailed(Code.ABORTED, f"{job} failed on worker {self.worker_id}: {exc}")

    # ------------------------------------------------------------------ Command
    async def command(self, request: "pb.CommandRequest") -> "pb.CommandResponse":
        """A leader command (G2 -> G3 demotion, G3 -> G2 promotion): a signed acknowledgement.
        Raises :class:`PlanRejected` when the command fails its checks (nothing moved)."""
        self._guard()
        batch = check_command(request.plan, self.gate.plan_key, self.pools.current)
        check_not_late(batch, time.monotonic())
        ticket = self._admit(batch)
        try:
            moved = await self._copy(batch, None, ticket)
        except JobFailed as exc:
            return self.ack(batch.job_id, False, exc.message)
        demote = batch.kind is PlanKind.DEMOTE
        self.counters.add("bytes_demoted" if demote else "bytes_promoted", moved.bytes)
        log.debug("job %d %s: %d blocks G2->G3, %d blocks G3->G2 in %.2f ms", batch.job_id, batch.kind.name.lower(),
                  len(batch.demote_host), len(batch.promote_host), moved.seconds * 1e3)
        return self.ack(batch.job_id, True)

    async def acknowledge(self, request: "pb.CommandRequest") -> "pb.CommandResponse":
        """:meth:`command` for transports without statuses (NATS): a rejection is an answer
        with ``ok=False``, signed when the plan (hence its job id) could be trusted."""
        try:
            return await self.command(request)
        except PlanRejected as exc:
            if exc.job_id is not None:
                return self.ack(exc.job_id, False, str(exc))
            return pb.CommandResponse(ok=False, error=str(exc), worker_id=self.worker_id)

    def ack(self, job_id: JobId, ok: bool, error: str = "") -> "pb.CommandResponse":
        """A command acknowledgement, signed so that only this node's worker can give it."""
        return pb.CommandResponse(ok=ok, error=error, worker_id=self.worker_id, job_id=job_id,
                                  signature=sign_ack(self.node_key, self.worker_id, job_id, ok, error))

