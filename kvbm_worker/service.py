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
from kvbm_client.ids import PlanKind, Tier

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


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkerService(rpc.WorkerServicer):
    """State of one worker: the engine region, the pools, and the leader's trust anchor."""

    def __init__(self, worker_id: str, rank: int, reporter) -> None:
        self.worker_id = worker_id
        self.rank = rank
        self.region: EngineRegion | None = None
        self.pools: Pools | None = None
        self.secret: bytes | None = None
        self.leader_id = ""
        self.closing = False
        self.alloc_progress = 0.0
        self.counters: dict[str, float] = {"bytes_stored": 0, "bytes_loaded": 0, "bytes_demoted": 0, "bytes_promoted": 0,
                                           "jobs_ok": 0, "jobs_failed": 0}
        self._reporter = reporter  # async (job_id, ok, error, bytes, seconds) -> accepted
        self._on_layout = None  # async callback when a region (layout) appears
        self.region_factory = EngineRegion  # request -> region; a GPU worker opens CUDA IPC buffers
        self._lanes = {"store": ThreadPoolExecutor(1, thread_name_prefix="kvbm-store"),
                       "load": ThreadPoolExecutor(1, thread_name_prefix="kvbm-load")}
        self._inflight = 0
        self._idle = asyncio.Condition()
        self._reports: set[asyncio.Task] = set()

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

    async def _verified(self, signed, context) -> "pb.TransferPlan":
        if self.secret is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is not attached to a leader")
        plan = verify_plan(signed, self.secret)
        if plan is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "plan is not signed by this node's leader")
        if self.pools is None or plan.epoch != self.pools.epoch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"plan for pool epoch {plan.epoch}; pools are at "
                                f"{self.pools.epoch if self.pools else 'none'}")
        if time.monotonic() >= plan.deadline:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"job {plan.job_id} is past its deadline")
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

    async def drain(self) -> None:
        """Wait until no copy is running (before pools or the region go away)."""
        async with self._idle:
            await self._idle.wait_for(lambda: self._inflight == 0)

    # ------------------------------------------------------------------ region
    async def RegisterRegion(self, request, context):
        await self._guard(context)
        old = self.region
        if old is not None:
            if old.pid == request.pid or _pid_alive(old.pid):
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
        if kind is PlanKind.LOAD and len(np.unique(blocks)) != len(blocks):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a load writes one engine block twice")
        # NOTE: numpy arrays, not per-entry Python objects: a 1250-block plan costs no Python loop here.
        batch = Batch(kind, np.asarray(plan.tiers, np.int64), np.asarray(plan.slots, np.int64), blocks,
                      list(plan.demote_host_slots), list(plan.demote_disk_slots))
        lane = "store" if kind is PlanKind.STORE else "load"
        try:
            moved, seconds = await self._execute(lane, batch, region)
        except Exception as exc:
            log.exception("job %d failed", plan.job_id)
            self.counters["jobs_failed"] += 1
            await self._reporter(plan.job_id, False, f"{type(exc).__name__}: {exc}", 0, 0.0)
            await context.abort(grpc.StatusCode.ABORTED, f"job {plan.job_id} failed on worker "
                                f"{self.worker_id}: {exc}")
        self.counters["bytes_stored" if kind is PlanKind.STORE else "bytes_loaded"] += moved
        self.counters["jobs_ok"] += 1
        log.debug("job %d %s: %d blocks, %d bytes in %.2f ms", plan.job_id, kind.name.lower(), len(blocks),
                  moved, seconds * 1e3)
        if kind is PlanKind.LOAD:
            # The bytes are in the engine's memory: answer now and confirm to the leader beside
            # it (its only effect is to unpin the slots, which a lost report does at the deadline).
            task = asyncio.ensure_future(self._reporter(plan.job_id, True, "", moved, seconds))
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)
            return pb.TransferResponse(job_id=plan.job_id, bytes=moved, seconds=seconds)
        accepted = await self._reporter(plan.job_id, True, "", moved, seconds)
        if kind is PlanKind.STORE and not accepted:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"job {plan.job_id}: bytes stored but the leader did not confirm them")
        return pb.TransferResponse(job_id=plan.job_id, bytes=moved, seconds=seconds)

    async def Command(self, request, context):
        await self._guard(context)
        plan = await self._verified(request.plan, context)
        if plan.kind not in (PlanKind.DEMOTE, PlanKind.PROMOTE):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan kind {plan.kind} is not a command")
        kind = PlanKind(plan.kind)
        batch = Batch(kind, [], [], [], list(plan.demote_host_slots), list(plan.demote_disk_slots),
                      list(plan.promote_host_slots), list(plan.promote_disk_slots))
        try:
            moved, seconds = await self._execute("store", batch, None)
        except Exception as exc:
            log.exception("%s job %d failed", kind.name.lower(), plan.job_id)
            return pb.CommandResponse(ok=False, error=f"{type(exc).__name__}: {exc}")
        self.counters["bytes_demoted" if kind is PlanKind.DEMOTE else "bytes_promoted"] += moved
        log.debug("job %d %s: %d blocks G2->G3, %d blocks G3->G2 in %.2f ms", plan.job_id, kind.name.lower(),
                  len(batch.demote_host), len(batch.promote_host), seconds * 1e3)
        return pb.CommandResponse(ok=True)

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
