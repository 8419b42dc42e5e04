"""The worker's gRPC service: validates every request against the registered region, the
allocated pools and the leader's signature before a single byte moves.

Runs in the worker daemon, on its event loop; copies run on lane threads.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np

from kvbm_client.contract import pb, rpc, verify_plan
from kvbm_client.procs import pid_alive
from kvbm_client.security import NodeKey, sign_ack
from kvbm_client.ids import PlanKind, Tier

from .jobs import Job, JobKey, JobTable
from .pools import DiskPool, HostPool
from .regions import EngineRegion, RegionError
from .transfers import Batch, TransferEngine

log = logging.getLogger("kvbm.worker")


@dataclass
class Pools:
    """One epoch's allocated tiers."""

    epoch: int
    host: HostPool | None
    disk: DiskPool | None
    engine: TransferEngine
    disk_backend: str = ""

    def slots(self, tier: Tier) -> int:
        pool = self.host if tier is Tier.HOST else self.disk if tier is Tier.DISK else None
        return pool.geometry.num_slots if pool is not None else 0

    def close(self) -> None:
        self.engine.close()
        if self.engine.disk_io is not None:
            self.engine.disk_io.close()
        for pool in (self.disk, self.host):
            if pool is not None:
                pool.close()


def _has_duplicates(values: np.ndarray) -> bool:
    # NOTE: not np.unique: its first call imports numpy.ma, which blocked the event loop for
    # 46 ms on the H100 host (the first load after start; DYN_LOG=debug "event loop stalled").
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


class JobFailed(Exception):
    """A transfer job's failure, as the gRPC status every caller of that job gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class WorkerService(rpc.WorkerServicer):
    """State of one worker: the engine region, the pools, and the leader's trust anchor."""

    def __init__(self, worker_id: str, rank: int, reporter, starter) -> None:
        self.worker_id = worker_id
        self.rank = rank
        self.region: EngineRegion | None = None
        self.pools: Pools | None = None
        self.secret: bytes | None = None
        self.leader_id = ""
        self.closing = False
        self.alloc_progress = 0.0
        self.counters: dict[str, float] = {"bytes_stored": 0, "bytes_loaded": 0, "bytes_demoted": 0, "bytes_promoted": 0,
                                           "jobs_ok": 0, "jobs_failed": 0, "jobs_joined": 0}
        self._reporter = reporter  # async (job_id, ok, error, bytes, seconds) -> accepted
        self._starter = starter  # async (job_id, epoch): the leader's go (StartTransfer), raises if not
        self.node_key: NodeKey | None = None
        self._on_layout = None  # async callback when a region (layout) appears
        self.region_factory = EngineRegion  # request -> region; a GPU worker opens CUDA IPC buffers
        self._lanes = {"store": ThreadPoolExecutor(1, thread_name_prefix="kvbm-store"),
                       "load": ThreadPoolExecutor(1, thread_name_prefix="kvbm-load")}
        self._inflight = 0
        self._idle = asyncio.Condition()
        self._reports: set[asyncio.Task] = set()
        self._jobs = JobTable()

    # ------------------------------------------------------------------ helpers
    async def _guard(self, context) -> None:
        if self.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is shutting down")

    def layout(self) -> "pb.KvLayout | None":
        r = self.region
        if r is None:
            return None
        return pb.KvLayout(num_layers=r.num_layers, page_bytes=r.page_bytes, dtype=r.dtype,
                           num_engine_blocks=r.num_blocks, rank=self.rank)

    @staticmethod
    async def _not_late(plan, context) -> None:
        if time.monotonic() >= plan.deadline:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"job {plan.job_id} is past its deadline")

    async def _verified(self, signed, context) -> "pb.TransferPlan":
        """The plan, if this node's leader signed it for the pools we have (its deadline is
        checked by the caller: a call that joins a running job may come after it)."""
        if self.secret is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is not attached to a leader")
        plan = verify_plan(signed, self.secret)
        if plan is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "plan is not signed by this node's leader")
        if self.pools is None or plan.epoch != self.pools.epoch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"plan for pool epoch {plan.epoch}; pools are at "
                                f"{self.pools.epoch if self.pools else 'none'}")
        pools = self.pools
        for name, slots, tier in (("demote_host_slots", plan.demote_host_slots, Tier.HOST),
                                  ("demote_disk_slots", plan.demote_disk_slots, Tier.DISK),
                                  ("promote_host_slots", plan.promote_host_slots, Tier.HOST),
                                  ("promote_disk_slots", plan.promote_disk_slots, Tier.DISK)):
            limit = pools.slots(tier)
            bad = next((s for s in slots if s >= limit), None)
            if bad is not None:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"{name}: slot {bad} >= {limit}")
        if (len(plan.demote_host_slots) != len(plan.demote_disk_slots)
                or len(plan.promote_host_slots) != len(plan.promote_disk_slots)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "demotion slot lists differ in length")
        if len(plan.tiers) != len(plan.slots):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "plan tiers and slots differ in length")
        tiers = np.asarray(plan.tiers, np.int64)
        slots = np.asarray(plan.slots, np.int64)
        limits = np.where(tiers == Tier.HOST, pools.slots(Tier.HOST),
                          np.where(tiers == Tier.DISK, pools.slots(Tier.DISK), 0))
        bad = np.flatnonzero(slots >= limits)
        if bad.size:
            i = int(bad[0])
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                f"slot {slots[i]} outside tier {tiers[i]} of {limits[i]} slots")
        return plan

    async def _execute(self, lane: str, batch: Batch, region: EngineRegion | None) -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        self._inflight += 1
        try:
            start = time.perf_counter()
            moved = await loop.run_in_executor(self._lanes[lane], self.pools.engine.run, batch, region)
            return moved, time.perf_counter() - start
        finally:
            self._inflight -= 1
            async with self._idle:
                self._idle.notify_all()

    async def warm_lanes(self) -> None:
        """The pools' engine pays its per-thread first-use costs on each lane, before any job."""
        engine = self.pools.engine if self.pools is not None else None
        if engine is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(loop.run_in_executor(pool, engine.warm_lane, lane)
                                   for lane, pool in self._lanes.items()))
        except Exception as exc:  # the jobs will report the same failure, one by one
            log.warning("lane warm-up failed (%s: %s); the first copies pay their first-use costs",
                        type(exc).__name__, exc)

    async def drain(self) -> None:
        """Wait until no copy is running (before pools or the region go away)."""
        async with self._idle:
            await self._idle.wait_for(lambda: self._inflight == 0)

    # ------------------------------------------------------------------ region
    async def RegisterRegion(self, request, context):
        await self._guard(context)
        old = self.region
        if old is not None:
            if old.pid == request.pid or pid_alive(old.pid):
                await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                    f"worker {self.worker_id} already serves engine {old.engine_id!r} "
                                    f"(pid {old.pid}, {old.region_id}); unregister it first")
            log.info("engine pid %d is gone; replacing its region %s", old.pid, old.region_id)
        try:
            region = self.region_factory(request)
        except RegionError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"region rejected: {exc}")
        if old is not None:
            await self.drain()
            self.region = None
            old.close()
        self.region = region
        log.info("engine %r (pid %d) registered %s: %d layers x %d blocks x %d bytes", region.engine_id,
                 region.pid, region.region_id, region.num_layers, region.num_blocks, region.page_bytes)
        if self._on_layout is not None:
            await self._on_layout()
        return pb.RegisterRegionResponse(region_id=region.region_id)

    async def UnregisterRegion(self, request, context):
        region = self.region
        if region is None or region.region_id != request.region_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown region {request.region_id!r}")
        self.region = None
        await self.drain()
        region.close()
        log.info("region %s unregistered", region.region_id)
        return pb.UnregisterRegionResponse()

    # ------------------------------------------------------------------ transfers
    async def Transfer(self, request, context):
        received = time.perf_counter()
        transit = max(0.0, time.time() - request.sent_at) if request.sent_at else 0.0
        await self._guard(context)
        region = self.region
        if region is None or region.region_id != request.region_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown region {request.region_id!r}")
        plan = await self._verified(request.plan, context)
        kind = PlanKind(plan.kind) if plan.kind in (1, 2, 3, 4) else None
        if kind not in (PlanKind.STORE, PlanKind.LOAD):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan kind {plan.kind} is not a transfer")
        blocks = np.asarray(request.engine_blocks, np.int64)
        if len(blocks) != len(plan.slots):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(blocks)} engine blocks for a plan of {len(plan.slots)} entries")
        if len(blocks) and int(blocks.max()) >= region.num_blocks:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                f"engine block {int(blocks.max())} outside 0..{region.num_blocks - 1}")
        if kind is PlanKind.LOAD and _has_duplicates(blocks):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a load writes one engine block twice")
        key = JobKey(plan.leader_id, plan.epoch, plan.job_id)
        job = self._jobs.get(key)
        joined = job is not None
        if job is None:
            await self._not_late(plan, context)
            # NOTE: numpy arrays, not per-entry Python objects: a 1250-block plan costs no Python loop here.
            batch = Batch(kind, np.asarray(plan.tiers, np.int64), np.asarray(plan.slots, np.int64), blocks,
                          list(plan.demote_host_slots), list(plan.demote_disk_slots))
            task = asyncio.ensure_future(self._run_job(plan, kind, batch, region))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # outcome read by the callers
            job = self._jobs.add(Job(key, region.region_id, blocks, plan.deadline, task), time.monotonic())
            log.debug("job %d %s: started, %d blocks (request in transit %.1f ms)", plan.job_id, kind.name.lower(),
                      len(blocks), transit * 1e3)
        elif not job.same_target(region.region_id, blocks):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"job {plan.job_id} was submitted before with other engine blocks")
        else:
            self.counters["jobs_joined"] += 1
            log.debug("job %d %s: joined (%s; request in transit %.1f ms)", plan.job_id, kind.name.lower(),
                      "done" if job.task.done() else "running", transit * 1e3)
        try:
            moved, seconds = await asyncio.shield(job.task)
        except JobFailed as exc:
            await context.abort(exc.code, exc.message)
        return pb.TransferResponse(job_id=plan.job_id, bytes=moved, seconds=seconds, joined=joined,
                                   waited_seconds=time.perf_counter() - received, transit_seconds=transit)

    async def _run_job(self, plan, kind: PlanKind, batch: Batch, region: EngineRegion) -> tuple[int, float]:
        """One transfer, whoever asked for it and whether or not they still wait: the leader's
        go, the copy, the counters and the leader's report. Raises :class:`JobFailed` with the
        status to answer."""
        await self._go(plan)
        try:
            moved, seconds = await self._execute("store" if kind is PlanKind.STORE else "load", batch, region)
        except Exception as exc:
            log.exception("job %d failed", plan.job_id)
            self.counters["jobs_failed"] += 1
            await self._reporter(plan.job_id, False, f"{type(exc).__name__}: {exc}", 0, 0.0)
            raise JobFailed(grpc.StatusCode.ABORTED,
                            f"job {plan.job_id} failed on worker {self.worker_id}: {exc}") from None
        self.counters["bytes_stored" if kind is PlanKind.STORE else "bytes_loaded"] += moved
        self.counters["jobs_ok"] += 1
        log.debug("job %d %s: %d blocks, %d bytes in %.2f ms", plan.job_id, kind.name.lower(),
                  len(batch.engine_blocks), moved, seconds * 1e3)
        if kind is PlanKind.LOAD:
            # The bytes are in the engine's memory: answer now and confirm to the leader beside
            # it (its only effect is to unpin the slots, which a lost report does at the deadline).
            task = asyncio.ensure_future(self._reporter(plan.job_id, True, "", moved, seconds))
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)
            return moved, seconds
        if not await self._reporter(plan.job_id, True, "", moved, seconds):
            raise JobFailed(grpc.StatusCode.UNAVAILABLE,
                            f"job {plan.job_id}: bytes stored but the leader did not confirm them")
        return moved, seconds

    async def _go(self, plan) -> None:
        """No byte of a job moves before the leader confirmed it is live (not released,
        expired or settled: a replayed plan stops here)."""
        try:
            await self._starter(plan.job_id, plan.epoch)
        except grpc.RpcError as exc:
            code = exc.code() if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                                grpc.StatusCode.DEADLINE_EXCEEDED) else grpc.StatusCode.UNAVAILABLE
            raise JobFailed(code, f"job {plan.job_id}: the leader did not let it start: {exc.details()}") from None

    def _ack(self, job_id: int, ok: bool, error: str = "") -> "pb.CommandResponse":
        """A command acknowledgement, signed so that only this node's worker can give it."""
        assert self.node_key is not None
        return pb.CommandResponse(ok=ok, error=error, worker_id=self.worker_id, job_id=job_id,
                                  signature=sign_ack(self.node_key, self.worker_id, job_id, ok, error))

    async def Command(self, request, context):
        await self._guard(context)
        plan = await self._verified(request.plan, context)
        await self._not_late(plan, context)
        if plan.kind not in (PlanKind.DEMOTE, PlanKind.PROMOTE):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan kind {plan.kind} is not a command")
        kind = PlanKind(plan.kind)
        batch = Batch(kind, [], [], [], list(plan.demote_host_slots), list(plan.demote_disk_slots),
                      list(plan.promote_host_slots), list(plan.promote_disk_slots))
        try:
            await self._go(plan)
        except JobFailed as exc:
            return self._ack(plan.job_id, False, exc.message)
        try:
            moved, seconds = await self._execute("store", batch, None)
        except Exception as exc:
            log.exception("%s job %d failed", kind.name.lower(), plan.job_id)
            return self._ack(plan.job_id, False, f"{type(exc).__name__}: {exc}")
        self.counters["bytes_demoted" if kind is PlanKind.DEMOTE else "bytes_promoted"] += moved
        log.debug("job %d %s: %d blocks G2->G3, %d blocks G3->G2 in %.2f ms", plan.job_id, kind.name.lower(),
                  len(batch.demote_host), len(batch.promote_host), seconds * 1e3)
        return self._ack(plan.job_id, True)

    async def Status(self, request, context):
        info = pb.WorkerInfo(worker_id=self.worker_id, rank=self.rank, alloc_progress=self.alloc_progress,
                             state="ready" if self.pools else "waiting")
        layout = self.layout()
        if layout is not None:
            info.layout.CopyFrom(layout)
        pools = self.pools
        if pools is not None:
            info.host_bytes = pools.host.geometry.total_bytes if pools.host else 0
            info.disk_bytes = pools.disk.geometry.total_bytes if pools.disk else 0
        return pb.WorkerStatusResponse(info=info, region_id=self.region.region_id if self.region else "",
                                       disk_path=pools.disk.path if pools and pools.disk else "",
                                       disk_backend=pools.disk_backend if pools else "",
                                       counters=self.counters)

    def shutdown_lanes(self) -> None:
        for pool in self._lanes.values():
            pool.shutdown(wait=True)
