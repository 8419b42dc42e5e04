"""The worker's service: its data-plane units and the gRPC ``Worker`` servicer over them.

Runs in the worker daemon, on its event loop. Owns, and starts and closes in order:

* the lanes (:mod:`.lanes`), the region registry (:mod:`.region_registry`) and its region
  socket (:mod:`.region_socket`), the pools (:mod:`.allocation`) and the job runner
  (:mod:`.runner`).

Who decides what: registrations (region socket only) and ``UnregisterRegion`` -> the region
registry; ``Transfer``/``Command`` -> the job runner (with :mod:`.plan_check`); ``Status`` ->
here. The gRPC methods only map refusals (:class:`~.errors.Refusal`) to statuses. gRPC
``RegisterRegion`` is refused (FAILED_PRECONDITION): memory is handed over as fds on the
region socket, never named by a path, and never over TCP.

Lifecycle: ``start()`` opens the region socket; ``close()`` refuses new requests, closes the
region socket, waits for the copies, stops the lanes, frees the pools and unmaps the regions
(reverse order of use); idempotent.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, AsyncIterator, Protocol

import grpc

from kvbm_client.config import KvbmConfig
from kvbm_client.contract import pb, rpc
from kvbm_client.ids import WorkerId
from kvbm_client.security import NodeKey
from kvbm_client.tasks import TaskSet

from .allocation import DataPath, PoolAllocator
from .errors import Refusal
from .lanes import Lanes
from .region_registry import RegionFactory, RegionRegistry
from .region_socket import RegionSocket
from .regions import EngineRegion, RegionLimits
from .leader_gate import LeaderGate
from .runner import JobRunner

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
        self.regions = RegionRegistry(worker_id, RegionLimits.of(config), factory, gate.layout_changed)
        self.pools = PoolAllocator(config, worker_id, path, self.lanes)
        self.runner = JobRunner(worker_id, self.lanes, self.regions, self.pools, gate, node_key)
        self.region_socket = RegionSocket(config.region_socket(worker_id), self.regions, lambda: self.runner.closing)
        self._staging = TaskSet(log, "stage")  # stages the leader sent (nobody waits for them)
        self._closed = False

    # ------------------------------------------------------------------ leader link peer
    def layout(self) -> "pb.KvLayout | None":
        return self.regions.layout(self.rank)

    async def apply_pool_plan(self, plan: "pb.PoolPlan") -> tuple[bool, str] | None:
        layout = self.layout()
        if layout is None:
            return None
        return await self.pools.apply(plan, layout)

    def stage(self, request: "pb.TransferRequest") -> None:
        self._staging.spawn(self.runner.stage_for_leader(request), "stage sent by the leader")

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self.region_socket.start()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.runner.closing = True
        await self._staging.close()
        await self.region_socket.close()
        await self.lanes.drain()
        self.lanes.close()
        self.pools.close()
        self.regions.close()

    # ------------------------------------------------------------------ gRPC
    @staticmethod
    async def _refuse(context: Any, exc: Refusal) -> None:
        await context.abort(exc.code, exc.message)

    async def RegisterRegion(self, request: "pb.RegisterRegionRequest", context: Any) -> "pb.RegisterRegionResponse":
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"register over the region socket {self.region_socket.path} (the KV memory is handed "
                            "over as sealed memfds or CUDA IPC handles there; never over gRPC)")
        raise AssertionError("not reached: abort raises")

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

    async def TransferLayers(self, request: "pb.TransferRequest", context: Any
                             ) -> AsyncIterator["pb.TransferProgress"]:
        try:
            async for progress in self.runner.transfer_layers(request):
                yield progress
        except Refusal as exc:
            await self._refuse(context, exc)

    async def Command(self, request: "pb.CommandRequest", context: Any) -> "pb.CommandResponse":
        try:
            return await self.runner.command(request)
        except Refusal as exc:
            await self._refuse(context, exc)
            raise  # not reached: abort raises

    async def Status(self, request: "pb.WorkerStatusRequest", context: Any) -> "pb.WorkerStatusResponse":
        progress = self.pools.progress
        pools = self.pools.current
        error = self.pools.error
        info = pb.WorkerInfo(worker_id=self.worker_id, rank=self.rank,
                             state="ready" if self.pools.ready else "failed" if error else "waiting", error=error,
                             alloc_progress=progress.fraction if progress is not None else 0.0)
        layout = self.layout()
        if layout is not None:
            info.layout.CopyFrom(layout)
        if pools is not None:
            info.host_bytes = pools.host.geometry.total_bytes if pools.host else 0
            info.disk_bytes = pools.disk.geometry.total_bytes if pools.disk else 0
            info.stage_bytes = pools.mover.stage_bytes
        regions = self.regions.summaries()  # NOTE: never a region id (a capability): digests
        return pb.WorkerStatusResponse(info=info, regions=regions,
                                       region_digest=regions[0].digest if regions else "",
                                       region_pid=regions[0].pid if regions else 0,
                                       region_socket=self.region_socket.path,
                                       disk_path=pools.disk.path if pools and pools.disk else "",
                                       disk_backend=pools.disk_backend if pools else "",
                                       counters=self.runner.counters.values)
