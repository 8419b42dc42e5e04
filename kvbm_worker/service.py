"""The worker's service: its data-plane units and the gRPC ``Worker`` servicer over them.

Runs in the worker daemon, on its event loop. Owns, and starts and closes in order:

* the lanes (:mod:`.lanes`), the region registry (:mod:`.region_registry`), the pools
  (:mod:`.allocation`) and the job runner (:mod:`.runner`).

Who decides what: ``RegisterRegion``/``UnregisterRegion`` -> the region registry;
``Transfer``/``Command`` -> the job runner (with :mod:`.plan_check`); ``Status`` -> here.
The gRPC methods only map refusals (:class:`~.errors.Refusal`) to statuses.

Lifecycle: ``close()`` refuses new requests, waits for the copies, stops the lanes, frees the
pools and unmaps the region (reverse order of use); idempotent.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Protocol

import grpc

from kvbm_client.config import KvbmConfig
from kvbm_client.contract import pb, rpc
from kvbm_client.ids import WorkerId
from kvbm_client.security import NodeKey

from .allocation import DataPath, PoolAllocator
from .errors import Refusal
from .lanes import Lanes
from .region_registry import RegionFactory, RegionRegistry
from .regions import EngineRegion, RegionLimits
from .runner import JobRunner, LeaderGate

log = logging.getLogger("kvbm.worker")


class Gate(LeaderGate, Protocol):
    """The leader gate plus the layout announcement (:class:`~.leader_link.LeaderLink`)."""

    async def layout_changed(self) -> None: ...


class WorkerService(rpc.WorkerServicer):  # type: ignore[misc]  # generated base class is untyped
    """State of one worker: engine region, pools, lanes and jobs; see the module docstring."""

    def __init__(self, config: KvbmConfig, worker_id: WorkerId, rank: int, gate: Gate, node_key: NodeKey,
                 path: DataPath = DataPath()) -> None:
        self.worker_id, self.rank = worker_id, rank
        self.lanes = Lanes(config.max_queued_jobs)
        factory: RegionFactory = EngineRegion
        if path.gpu is not None:
            from .handlers.cuda import open_region  # lazy: CUDA only on a GPU worker
            factory = functools.partial(open_region, device=path.gpu)
        self.regions = RegionRegistry(worker_id, RegionLimits.of(config), factory, self.lanes.drain,
                                      gate.layout_changed)
        self.pools = PoolAllocator(config, worker_id, path, self.lanes)
        self.runner = JobRunner(worker_id, self.lanes, self.regions, self.pools, gate, node_key)
        self._closed = False

    # ------------------------------------------------------------------ leader link peer
    def layout(self) -> "pb.KvLayout | None":
        return self.regions.layout(self.rank)

    async def apply_pool_plan(self, plan: "pb.PoolPlan") -> tuple[bool, str] | None:
        layout = self.layout()
        if layout is None:
            return None
        return await self.pools.apply(plan, layout)

    # ------------------------------------------------------------------ lifecycle
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.runner.closing = True
        await self.lanes.drain()
        self.lanes.close()
        self.pools.close()
        self.regions.close()

    # ------------------------------------------------------------------ gRPC
    @staticmethod
    async def _refuse(context: Any, exc: Refusal) -> None:
        await context.abort(exc.code, exc.message)

    async def RegisterRegion(self, request: "pb.RegisterRegionRequest", context: Any) -> "pb.RegisterRegionResponse":
        if self.runner.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is shutting down")
        try:
            region = await self.regions.register(request)
        except Refusal as exc:
            await self._refuse(context, exc)
        return pb.RegisterRegionResponse(region_id=region.region_id)

    async def UnregisterRegion(self, request: "pb.UnregisterRegionRequest", context: Any
                               ) -> "pb.UnregisterRegionResponse":
        try:
            await self.regions.unregister(request.region_id)
        except Refusal as exc:
            await self._refuse(context, exc)
        return pb.UnregisterRegionResponse()

    async def Transfer(self, request: "pb.TransferRequest", context: Any) -> "pb.TransferResponse":
        try:
            return await self.runner.transfer(request)
        except Refusal as exc:
            await self._refuse(context, exc)
            raise  # not reached: abort raises

    async def Command(self, request: "pb.CommandRequest", context: Any) -> "pb.CommandResponse":
        try:
            return await self.runner.command(request)
        except Refusal as exc:
            await self._refuse(context, exc)
            raise  # not reached: abort raises

    async def Status(self, request: "pb.WorkerStatusRequest", context: Any) -> "pb.WorkerStatusResponse":
        progress = self.pools.progress
        pools = self.pools.current
        info = pb.WorkerInfo(worker_id=self.worker_id, rank=self.rank, state="ready" if pools else "waiting",
                             alloc_progress=progress.fraction if progress is not None else 0.0)
        layout = self.layout()
        if layout is not None:
            info.layout.CopyFrom(layout)
        if pools is not None:
            info.host_bytes = pools.host.geometry.total_bytes if pools.host else 0
            info.disk_bytes = pools.disk.geometry.total_bytes if pools.disk else 0
        region = self.regions.region
        # NOTE: region_id stays filled until regions move to the region socket (the vLLM
        # connector's early loads still read it); region_digest is what replaces it.
        return pb.WorkerStatusResponse(info=info, region_id=region.region_id if region else "",
                                       region_digest=self.regions.digest,
                                       disk_path=pools.disk.path if pools and pools.disk else "",
                                       disk_backend=pools.disk_backend if pools else "",
                                       counters=self.runner.counters.values)
