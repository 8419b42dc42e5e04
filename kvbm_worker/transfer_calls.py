"""The ``Transfer`` and ``TransferLayers`` calls of a worker: a request checked, its job started
or joined, the call's answer.

A base of :class:`~.runner.JobRunner`, on the daemon's event loop (the job itself, the runner's
``_run_job``, runs as a task beside the calls). What it uses of the runner (the region registry,
the pools, the leader gate, the job table, the counters, the shutdown guard, lane admission and
``_run_job``) is declared here and defined there.

A job runs once per plan: a call whose plan already has a job (running or recently done,
:class:`~.jobs.JobTable`) joins it and gets its outcome, if it names the same region and engine
blocks (else INVALID_ARGUMENT); a new job is checked against its deadline and takes a place in
its lane (steps 1 and 2 of :mod:`.runner`). An UNAVAILABLE from the plan check (no leader
attached) is answered ABORTED: this daemon and the region are still here.

``TransferLayers`` (a load run in layer groups, :class:`~.jobs.Landed`) takes the same checks
and ends with the same codes; before its outcome it streams the pages landed so far, which
never vouch for the bytes (only the outcome does). Layer groups are for loads only, at most
:data:`~kvbm_client.contract.MAX_LAYER_GROUPS`; a load that reads G3 lands whole blocks.

A ``Transfer`` with ``stage`` (:mod:`.stages`) stages a load before its engine blocks exist: the
plan's checks, then its first layer group into the staging area on the load lane, the leader's
go asked beside the copy; the first call of the same plan that names the blocks starts the job
with them once that go came (no second go: the stage's stands). A stage that cannot be made is
FAILED_PRECONDITION; nothing moved. The leader sends such a request itself when a client's
lookup asks for it (:meth:`TransferCalls.stage_for_leader`; nobody waits for its answer).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

import grpc

from kvbm_client.contract import MAX_LAYER_GROUPS, pb
from kvbm_client.ids import PlanKind

from .allocation import PoolAllocator
from .errors import PlanRejected, Refusal
from .grouping import groupable
from .jobs import Job, JobTable, Landed, Moved
from .lanes import Ticket
from .leader_gate import LeaderGate
from .plan_check import Batch, check_not_late, check_stage, check_transfer
from .region_registry import RegionRegistry
from .regions import EngineRegion
from .signals import JobSignals, request_target
from .stages import StageArea, StagedLoad, StageLayout

if TYPE_CHECKING:
    from .runner import Counters

log = logging.getLogger("kvbm.worker")
Code = grpc.StatusCode


def _transit(request: "pb.TransferRequest", arrived: float) -> float:
    """Seconds from the sender's clock at sending (``sent_at``) to ``arrived`` (0: not given)."""
    return max(0.0, arrived - request.sent_at) if request.sent_at else 0.0


@dataclass(frozen=True, slots=True)
class _Call:
    """One ``Transfer``/``TransferLayers`` call: the job it started or joined."""

    job: Job
    region: EngineRegion
    joined: bool
    received: float  # perf_counter when the call arrived
    transit: float  # seconds from the client's send to arrival

    def response(self, moved: Moved) -> "pb.TransferResponse":
        return pb.TransferResponse(job_id=self.job.key.job_id, bytes=moved.bytes, seconds=moved.seconds,
                                   joined=self.joined, waited_seconds=time.perf_counter() - self.received,
                                   transit_seconds=self.transit)


class TransferCalls:
    """The transfer calls of a :class:`~.runner.JobRunner` (its state is the runner's: see there)."""

    regions: RegionRegistry
    pools: PoolAllocator
    gate: LeaderGate
    counters: Counters
    _jobs: JobTable
    stages: StageArea

    if TYPE_CHECKING:  # the runner's (JobRunner defines them)
        def _guard(self) -> None: ...

        def _admit(self, batch: Batch) -> Ticket: ...

        async def _run_job(self, batch: Batch, region: EngineRegion, ticket: Ticket,
                           landed: Landed | None = None, staged: StagedLoad | None = None) -> Moved: ...

        async def _run_stage(self, batch: Batch, region: EngineRegion, ticket: Ticket, load: StagedLoad
                             ) -> float: ...

    # ------------------------------------------------------------------ Transfer
    async def transfer(self, request: "pb.TransferRequest") -> "pb.TransferResponse":
        if request.stage:
            return await self._stage(request)
        call = self._start_or_join(request)
        moved = await asyncio.shield(call.job.task)
        return call.response(moved)

    async def transfer_layers(self, request: "pb.TransferRequest") -> AsyncIterator["pb.TransferProgress"]:
        """``TransferLayers``: the job's landed pages as they grow, then its outcome. A job
        that fails raises (after the pages that landed were reported: the caller's whole load
        counts as failed)."""
        if request.stage:
            raise PlanRejected(Code.INVALID_ARGUMENT, "a stage is a Transfer call, not TransferLayers")
        call = self._start_or_join(request)
        landed = call.job.landed
        per_block = landed.pages_per_block if landed is not None else call.region.num_layers
        sent = 0
        while landed is not None and not call.job.task.done():
            changed = landed.waiter()
            if landed.pages > sent:
                sent = landed.pages
                yield pb.TransferProgress(pages_landed=sent, pages_per_block=per_block)
                continue
            waiter = asyncio.ensure_future(changed.wait())
            try:  # (a caller that goes away cancels this call here)
                await asyncio.wait((waiter, call.job.task), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        moved = await asyncio.shield(call.job.task)
        yield pb.TransferProgress(pages_landed=per_block, pages_per_block=per_block, done=call.response(moved))

    async def _stage(self, request: "pb.TransferRequest") -> "pb.TransferResponse":
        """A ``Transfer`` with ``stage``: checked, then staged, the leader's go asked beside the
        copy (module docstring); answered once both are done."""
        received, arrived = time.perf_counter(), time.time()
        transit = _transit(request, arrived)
        self._guard()
        region = self.regions.get(request.region_id)
        if region is None:
            raise PlanRejected(Code.NOT_FOUND, f"unknown region {request.region_id!r}")
        try:
            batch = check_stage(request.plan, self.gate.plan_key, self.pools.current)
        except PlanRejected as exc:
            if exc.code is Code.UNAVAILABLE:
                raise PlanRejected(Code.ABORTED, exc.message, exc.job_id) from None
            raise
        job_id = batch.job_id
        if request.engine_blocks or request.signal_slot:
            raise PlanRejected(Code.INVALID_ARGUMENT, f"job {job_id}: a stage names no engine blocks and no "
                                                      "signal word (the call that names the blocks does)", job_id)
        groups = self._layer_groups(request, batch, region)
        now = time.monotonic()
        check_not_late(batch, now)

        def refuse(why: str) -> PlanRejected:
            log.debug("job %d load: not staged, %s", job_id, why)
            return PlanRejected(Code.FAILED_PRECONDITION, f"job {job_id}: not staged, {why}", job_id)
        if groups < 2:
            raise refuse("a stage takes a load's leading layer groups (layer_groups >= 2)")
        if self._jobs.get(batch.job) is not None:
            raise refuse("its job has started")
        pools = self.pools.current
        assert pools is not None  # (check_stage verified the plan's epoch against them)
        why = pools.mover.stage_refusal(region)
        if why is not None:
            if not pools.mover.stage_bytes and not self.stages.refused_no_area:
                self.stages.refused_no_area = True  # (once: an engine with staged_loads asks at every hit)
                log.info("an engine asks to stage its loads (staged_loads), but %s: every stage is refused and "
                         "its loads run unstaged", why)
            raise refuse(why)
        bounds = self.pools.path.pacing.bounds(region.num_layers, groups)
        layout = StageLayout.fit(len(batch.slots), bounds, region.page_bytes, pools.mover.stage_bytes)
        if layout is None:
            raise refuse(f"its first layer group of {len(batch.slots)} blocks is over the staging area "
                         f"({pools.mover.stage_bytes >> 20} MiB)")
        load = self.stages.claim(batch.job, region.region_id, layout, now, batch.deadline)
        if load is None:
            raise refuse("the staging area holds another load")
        try:
            ticket = self._admit(batch)
        except PlanRejected:
            self.stages.release(load)
            raise
        task = load.task = asyncio.ensure_future(self._run_stage(batch, region, ticket, load))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (also read by the binding call)
        await asyncio.shield(task)
        log.debug("job %d load: staged %d of %d layer groups, %d blocks (%.1f MiB), in %.2f ms (request in transit "
                  "%.1f ms, arrived at %.6f)", job_id, layout.staged, len(bounds), layout.blocks,
                  layout.nbytes / (1 << 20), (time.perf_counter() - received) * 1e3, transit * 1e3, arrived)
        return pb.TransferResponse(job_id=job_id, bytes=layout.nbytes, waited_seconds=time.perf_counter() - received)

    async def stage_for_leader(self, request: "pb.TransferRequest") -> None:
        """A stage the leader sent on the attach stream for a client's lookup
        (``PrepareLoadRequest.stage``): checked and run as a client's; nobody waits for its
        answer, so a refusal is logged (at debug level: a busy area is routine)."""
        try:
            await self._stage(request)
        except Refusal as exc:
            log.debug("stage sent by the leader refused: %s (%s)", exc.message, exc.code.name)

    def _start_or_join(self, request: "pb.TransferRequest") -> "_Call":
        """Check ``request`` and start its job, or join the job of the same plan."""
        received = time.perf_counter()
        transit = _transit(request, time.time())
        self._guard()
        region = self.regions.get(request.region_id)
        if region is None:
            raise PlanRejected(Code.NOT_FOUND, f"unknown region {request.region_id!r}")
        try:
            batch = check_transfer(request.plan, self.gate.plan_key, self.pools.current, region, request.engine_blocks)
        except PlanRejected as exc:
            if exc.code is Code.UNAVAILABLE:  # not attached to a leader: this daemon and the region are still here
                raise PlanRejected(Code.ABORTED, exc.message, exc.job_id) from None
            raise
        groups = self._layer_groups(request, batch, region)
        target = request_target(request, region, batch)
        kind = batch.kind.name.lower()
        job = self._jobs.get(batch.job)
        joined = job is not None
        if job is None:
            now = time.monotonic()
            check_not_late(batch, now)
            ticket = self._admit(batch)
            staged = self.stages.take(batch.job, region.region_id, now) if batch.kind is PlanKind.LOAD else None
            signals = JobSignals(region.signals) if region.signals is not None else None
            landed = Landed(region.num_layers, groups, signals=signals) if groups > 1 else None
            task = asyncio.ensure_future(self._run_job(batch, region, ticket, landed, staged))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # outcome read by the callers
            job = self._jobs.add(Job(batch.job, region.region_id, batch.engine_blocks, batch.deadline, task, landed),
                                 time.monotonic())
            log.debug("job %d %s: started, %d blocks%s (request in transit %.1f ms)", batch.job_id, kind,
                      len(batch.engine_blocks), f" in {groups} layer groups" if groups > 1 else "", transit * 1e3)
        elif not job.same_target(region.region_id, batch.engine_blocks):
            raise PlanRejected(Code.INVALID_ARGUMENT,
                               f"job {batch.job_id} was submitted before with other engine blocks", batch.job_id)
        else:
            self.counters.add("jobs_joined")
            log.debug("job %d %s: joined (%s; request in transit %.1f ms)", batch.job_id, kind,
                      "done" if job.task.done() else "running", transit * 1e3)
        if target is not None and job.landed is not None and job.landed.signals is not None:
            job.landed.signals.add(target)  # (a job of whole blocks: the engine writes the word at its outcome)
        return _Call(job, region, joined, received, transit)

    @staticmethod
    def _layer_groups(request: "pb.TransferRequest", batch: Batch, region: EngineRegion) -> int:
        """The groups a new job of ``request`` runs in (1: whole blocks; more than the region's
        pages per block: one page per group). Raises INVALID_ARGUMENT for a count over
        :data:`MAX_LAYER_GROUPS` or on a plan that is not a load."""
        groups = int(request.layer_groups)
        if groups <= 1:
            return 1
        if batch.kind is not PlanKind.LOAD:
            raise PlanRejected(Code.INVALID_ARGUMENT, f"job {batch.job_id}: layer_groups applies to loads only",
                               batch.job_id)
        if groups > MAX_LAYER_GROUPS:
            raise PlanRejected(Code.INVALID_ARGUMENT,
                               f"job {batch.job_id}: layer_groups={groups}, at most {MAX_LAYER_GROUPS}", batch.job_id)
        if not groupable(batch):
            return 1  # G3 reads land whole blocks (the bounce pipeline); the answer says when
        return min(groups, region.num_layers)
