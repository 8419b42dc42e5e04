"""The engine region a worker serves: registration, replacement of a dead owner's region,
removal, and the layout it implies.

Runs in the worker daemon, on its event loop. Transport-free: the gRPC servicer calls it
today; the region socket (SCM_RIGHTS, a later phase) will call :meth:`RegionRegistry.register`
the same way. Refusals are :class:`~.errors.RegionRejected` with their status.

Invariants: a request is checked against the limits (:func:`~.regions.check_request`) before
anything is opened or mapped; a region is closed only after every copy that could touch it
finished (``drain``).
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

import grpc

from kvbm_client.contract import pb
from kvbm_client.procs import pid_alive
from kvbm_client.security import region_digest

from .errors import RegionRejected
from .regions import EngineRegion, RegionError, RegionLimits, check_request

log = logging.getLogger("kvbm.worker")

RegionFactory = Callable[["pb.RegisterRegionRequest"], EngineRegion]


class RegionRegistry:
    """Holds at most one :class:`EngineRegion` (one engine per worker today).

    Args:
        worker_id: for messages.
        limits: what one request may describe.
        factory: maps a request (CPU shared memory; a GPU worker also opens CUDA IPC handles).
        drain: waits until no copy runs (the lanes').
        on_change: called after a region appeared (the leader link sends the layout).
    """

    def __init__(self, worker_id: str, limits: RegionLimits, factory: RegionFactory,
                 drain: Callable[[], Awaitable[None]], on_change: Callable[[], Awaitable[None]]) -> None:
        self.worker_id = worker_id
        self.limits = limits
        self.factory = factory
        self._drain, self._on_change = drain, on_change
        self.region: EngineRegion | None = None

    def get(self, region_id: str) -> EngineRegion | None:
        region = self.region
        return region if region is not None and region.region_id == region_id else None

    @property
    def digest(self) -> str:
        return region_digest(self.region.region_id) if self.region is not None else ""

    def layout(self, rank: int) -> "pb.KvLayout | None":
        r = self.region
        if r is None:
            return None
        return pb.KvLayout(num_layers=r.num_layers, page_bytes=r.page_bytes, dtype=r.dtype,
                           num_engine_blocks=r.num_blocks, rank=rank)

    async def register(self, request: "pb.RegisterRegionRequest") -> EngineRegion:
        old = self.region
        if old is not None:
            if old.pid == request.pid or pid_alive(old.pid):
                raise RegionRejected(grpc.StatusCode.ALREADY_EXISTS,
                                     f"worker {self.worker_id} already serves engine {old.engine_id!r} "
                                     f"(pid {old.pid}, {old.region_id}); unregister it first")
            log.info("engine pid %d is gone; replacing its region %s", old.pid, old.region_id)
        try:
            check_request(request, self.limits)
            region = self.factory(request)
        except RegionError as exc:
            raise RegionRejected(grpc.StatusCode.INVALID_ARGUMENT, f"region rejected: {exc}") from None
        if old is not None:
            self.region = None
            await self._drain()
            old.close()
        self.region = region
        log.info("engine %r (pid %d) registered %s: %d layers x %d blocks x %d bytes", region.engine_id,
                 region.pid, region.region_id, region.num_layers, region.num_blocks, region.page_bytes)
        await self._on_change()
        return region

    async def unregister(self, region_id: str) -> None:
        region = self.get(region_id)
        if region is None:
            raise RegionRejected(grpc.StatusCode.NOT_FOUND, f"unknown region {region_id!r}")
        self.region = None
        await self._drain()
        region.close()
        log.info("region %s unregistered", region.region_id)

    def close(self) -> None:
        """Unmap the region (after the lanes drained); idempotent."""
        if self.region is not None:
            self.region.close()
            self.region = None
