"""The engine regions a worker serves: registration, removal, and the layout they imply.

Runs in the worker daemon, on its event loop. Transport-free: the region socket
(:mod:`.region_socket`) registers (with the fds and the peer it received) and drops a region
when its connection ends; the gRPC servicer unregisters by id. Refusals are
:class:`~.errors.RegionRejected` with their status.

Several engines, one cache: a worker holds up to ``DYN_KVBM_MAX_REGIONS`` regions at once
(engine processes of one model on one node), all of one :class:`~.regions.RegionShape`
(their blocks share the pools' slots); ``num_blocks`` may differ. Transfers name their
region by id (a capability, 128 random bits, never shown: Status shows digests).

Invariants: a request is checked against the limits (:func:`~.regions.check_request`) before
anything is mapped; a region is closed only after the copies holding it finished
(:meth:`~.regions.EngineRegion.retire`); the layout announced to the leader changes only
when a region of another shape registers while no region is held.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Sequence

import grpc

from kvbm_client.contract import pb
from kvbm_client.security import region_digest

from .errors import RegionRejected
from .regions import EngineRegion, Peer, RegionError, RegionLimits, RegionShape, check_request
from .signals import map_signal_page

log = logging.getLogger("kvbm.worker")

RegionFactory = Callable[["pb.RegisterRegionRequest", Sequence[int], Peer], EngineRegion]


class RegionRegistry:
    """The regions of one worker (see the module docstring).

    Args:
        worker_id: for messages.
        limits: what one request may describe, and how many regions are held.
        factory: maps a request (memfds; a GPU worker also opens CUDA IPC handles).
        on_change: called when the layout appears (a first region) or changes (the leader link sends it).
    """

    def __init__(self, worker_id: str, limits: RegionLimits, factory: RegionFactory,
                 on_change: Callable[[], Awaitable[None]]) -> None:
        self.worker_id = worker_id
        self.limits = limits
        self.factory = factory
        self._on_change = on_change
        self._regions: dict[str, EngineRegion] = {}  # registration order (oldest first)
        self._gone: dict[str, asyncio.Event] = {}
        #: NOTE: the layout last announced, kept while no region is held: an engine that comes
        #: back with the same shape (another num_blocks) must not make the leader replan the pools
        self._announced: pb.KvLayout | None = None

    def get(self, region_id: str) -> EngineRegion | None:
        return self._regions.get(region_id)

    @property
    def regions(self) -> list[EngineRegion]:
        return list(self._regions.values())

    def summaries(self) -> list["pb.RegionSummary"]:
        """What Status shows of each region (never its id)."""
        return [pb.RegionSummary(digest=region_digest(r.region_id), pid=r.pid, engine_id=r.engine_id,
                                 num_blocks=r.num_blocks) for r in self._regions.values()]

    def layout(self, rank: int) -> "pb.KvLayout | None":
        """The layout the leader plans the pools with; None while no region is held."""
        if not self._regions or self._announced is None:
            return None
        layout = pb.KvLayout()
        layout.CopyFrom(self._announced)
        layout.rank = rank
        return layout

    async def register(self, request: "pb.RegisterRegionRequest", fds: Sequence[int], owner: Peer) -> EngineRegion:
        """Map a region for ``owner``; raises :class:`RegionRejected`. ``fds`` stay the caller's."""
        if len(self._regions) >= self.limits.max_regions:
            raise RegionRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"worker {self.worker_id} holds {len(self._regions)} engine regions; at most "
                                 f"{self.limits.max_regions} (DYN_KVBM_MAX_REGIONS)")
        shape = RegionShape(len(request.layers), int(request.page_bytes), request.dtype)
        held = self.shape
        if held is not None and shape != held:
            raise RegionRejected(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"region of {shape} refused: worker {self.worker_id} serves engines of {held} "
                                 "(engines that share a worker's cache have one layout)")
        try:
            check_request(request, self.limits)
            page = map_signal_page(request, fds)  # (its fd is the last one)
            try:
                region = self.factory(request, fds[:-1] if page is not None else fds, owner)
            except BaseException:
                if page is not None:
                    page.close()
                raise
            if page is not None:
                try:
                    region.attach_signals(page)
                except BaseException:
                    region.close()
                    raise
        except RegionError as exc:
            raise RegionRejected(grpc.StatusCode.INVALID_ARGUMENT, f"region rejected: {exc}") from None
        self._regions[region.region_id] = region
        self._gone[region.region_id] = asyncio.Event()
        log.info("engine %r (pid %d) registered region %s: %d layers x %d blocks x %d bytes%s (%d regions held)",
                 region.engine_id, region.pid, region_digest(region.region_id), region.num_layers, region.num_blocks,
                 region.page_bytes, ", with a signal page" if region.signals is not None else "", len(self._regions))
        announced = self._announced
        if announced is None or RegionShape(announced.num_layers, announced.page_bytes, announced.dtype) != shape:
            self._announced = pb.KvLayout(num_layers=region.num_layers, page_bytes=region.page_bytes,
                                          dtype=region.dtype, num_engine_blocks=region.num_blocks)
        if len(self._regions) == 1:  # the first region: (re)announce the layout, the pools follow it
            await self._on_change()
        return region

    @property
    def shape(self) -> RegionShape | None:
        """The shape every held region has; None while none is held."""
        first = next(iter(self._regions.values()), None)
        return first.shape if first is not None else None

    async def unregister(self, region_id: str) -> None:
        """Drop a region once no copy holds it; NOT_FOUND if it is not held."""
        region = self._regions.pop(region_id, None)
        if region is None:
            raise RegionRejected(grpc.StatusCode.NOT_FOUND, "unknown region (a region id is known only to the "
                                                            "engine that registered it)")
        self._gone.pop(region_id).set()
        await region.retire()
        region.close()
        log.info("region %s of engine %r (pid %d) unregistered (%d regions held)", region_digest(region_id),
                 region.engine_id, region.pid, len(self._regions))

    async def wait_gone(self, region_id: str) -> None:
        """Return once ``region_id`` is no longer held (unregistered by id, or the worker closing)."""
        gone = self._gone.get(region_id)
        if gone is not None:
            await gone.wait()

    def close(self) -> None:
        """Unmap every region (after the lanes drained); idempotent."""
        for region_id, region in list(self._regions.items()):
            region.retired = True
            region.close()
            self._gone.pop(region_id).set()
        self._regions.clear()
