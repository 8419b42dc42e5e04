"""The worker side's link to its worker daemon: the engine's KV region, held registered.

Runs in an engine worker process. Owns the gRPC channel to the daemon, the region lease (the
open region-socket connection that keeps the engine's memory registered: :mod:`...region_wire`),
the retry backoff and a watchdog thread; one lock guards all of them (the engine's thread
submits transfers while the watchdog may re-dial or re-register). Each registration's id is
also published for this engine's scheduler side (:mod:`.region_ids`).

A daemon that restarted (kill -9, upgrade) has no region any more and the leader needs our
layout again before it can plan pools, so no failed transfer would tell us: every
``retry_s``, also while the engine is idle, the watchdog checks that the lease is open and
that the daemon's Status lists our region's digest, and registers it again when not.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from ...channels import open_channel
from ...contract import pb, rpc
from ...errors import KvbmError
from ...ids import EngineBlockId, WorkerId
from ...region_wire import RegionLease, register
from ...regions import RegionSpecLike
from ...security import region_digest
from .layerwise import GpuWait, READER_THREADS, LayerwiseCall
from .region_ids import EngineRegionIds
from .settings import Backoff, ConnectorSettings

log = logging.getLogger("kvbm.connector")

#: codes after which the daemon is dialled afresh / asked for our region again
LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)


class RegionLink:
    """One engine region on one worker daemon, kept registered."""

    def __init__(self, worker_id: WorkerId, settings: ConnectorSettings) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self.address = settings.worker_address(worker_id)
        self.region_socket = settings.region_socket(worker_id)
        self.ids = EngineRegionIds(settings.config.resolved_socket_dir, settings.engine_id)
        self._lock = threading.Lock()  # guards everything below
        self._spec: RegionSpecLike | None = None
        self._lease: RegionLease | None = None
        self._channel = open_channel(self.address, settings.config)
        self._stub: Any = rpc.WorkerStub(self._channel)  # the generated stubs are untyped
        self._backoff = Backoff(settings.retry_s)
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="kvbm-region-watchdog", daemon=True)
        self._readers: ThreadPoolExecutor | None = None  # read TransferLayers streams

    @property
    def region_id(self) -> str | None:
        with self._lock:
            return self._lease.region_id if self._lease is not None else None

    def register(self, spec: RegionSpecLike) -> None:
        """Register the engine's memory and wait (bounded by ``ready_timeout_s``) until the
        daemon allocated its pools, so the first requests' blocks are not skipped; then keep
        it registered."""
        with self._lock:
            self._spec = spec
            if self._ensure_region():
                self._wait_pools()
        if not self._watchdog.is_alive():
            self._watchdog.start()

    def submit(self, plan: bytes, signature: bytes, blocks: list[EngineBlockId],
               timeout: float | None = None, layer_groups: int = 0,
               gpu: GpuWait | None = None) -> "grpc.Future[Any] | LayerwiseCall | None":
        """Send one signed plan for ``blocks``, answered within ``timeout`` seconds (default: the
        old fixed wait); None when no region is registered now. ``layer_groups`` > 1: a load
        copied in that many layer groups, its progress streamed (:class:`LayerwiseCall`);
        ``gpu``: its word on the signal page (the daemon writes it as groups land)."""
        with self._lock:
            if not self._ensure_region():
                return None
            assert self._lease is not None
            request = pb.TransferRequest(region_id=self._lease.region_id,
                                         plan=pb.SignedPlan(plan=plan, signature=signature),
                                         engine_blocks=blocks, sent_at=time.time(), layer_groups=max(0, layer_groups))
            if gpu is not None and layer_groups > 1:
                request.signal_slot, request.signal_base = gpu.signal.slot + 1, gpu.signal.base
            wait = max(self.settings.timeout_s, 30.0) if timeout is None else timeout
            if layer_groups > 1:
                if self._readers is None:
                    self._readers = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="kvbm-layers")
                return LayerwiseCall(self._stub.TransferLayers(request, timeout=wait), self._readers, gpu)
            future: grpc.Future[Any] = self._stub.Transfer.future(request, timeout=wait)
            return future

    def failed(self, exc: BaseException) -> None:
        """A transfer failed with ``exc``: when the daemon went away or forgot our region,
        register again (after ``retry_s``) and re-dial a restarted daemon."""
        if isinstance(exc, grpc.RpcError):
            with self._lock:
                self._lost(exc.code())

    def close(self) -> None:
        """Stop the watchdog, unregister the region (end its lease), close the channel; idempotent."""
        self._stop.set()
        with self._lock:
            self._drop_lease()
            self._channel.close()
            if self._readers is not None:
                self._readers.shutdown(wait=False)
                self._readers = None

    # ------------------------------------------------------------------ under the lock
    def _ensure_region(self) -> bool:
        if self._lease is not None:
            return True
        if self._spec is None or self._stop.is_set() or not self._backoff.ready():
            return False
        try:
            self._lease = register(self.region_socket, self._spec.to_request(), self._spec.fds,
                                   self.settings.timeout_s)
        except KvbmError as exc:
            log.warning("kvbm worker %s (%s): %s; retrying in %gs", self.worker_id, self.region_socket, exc,
                        self.settings.retry_s)
            self._backoff.failed()
            return False
        try:
            self.ids.publish(self.worker_id, self._lease.region_id)
        except (OSError, KvbmError) as exc:  # early loads only: the scheduler side cannot start them
            log.warning("kvbm: cannot publish the region for the scheduler side (%s); no early loads", exc)
        log.info("kvbm: engine KV cache registered with worker %s (region %s)", self.worker_id,
                 region_digest(self._lease.region_id))
        return True

    def _drop_lease(self) -> None:
        if self._lease is not None:
            self._lease.close()
            self._lease = None
            self.ids.withdraw(self.worker_id)

    def _wait_pools(self) -> None:
        end = time.monotonic() + self.settings.ready_timeout_s
        while time.monotonic() < end:
            try:
                status = self._stub.Status(pb.WorkerStatusRequest(), timeout=self.settings.timeout_s)
            except grpc.RpcError:
                return
            if status.info.state == "ready":
                return
            if status.info.state == "failed":  # waiting would not help: the node must be fixed
                log.error("kvbm worker %s could not allocate its pools (%s); the engine starts without "
                          "kvbm: nothing is offloaded or loaded until the node is fixed and re-planned",
                          self.worker_id, status.info.error or "no reason given")
                return
            time.sleep(0.1)
        log.warning("kvbm worker %s: pools not ready after %gs; starting anyway", self.worker_id,
                    self.settings.ready_timeout_s)

    def _lost(self, code: grpc.StatusCode) -> None:
        if code not in LOST_CODES:
            return
        if self._lease is not None:
            log.warning("kvbm worker %s lost (%s); will re-register", self.worker_id, code.name)
        self._drop_lease()
        self._backoff.failed()
        if code == grpc.StatusCode.UNAVAILABLE and not self._stop.is_set():  # dial a restarted daemon afresh
            self._channel.close()
            self._channel = open_channel(self.address, self.settings.config)
            self._stub = rpc.WorkerStub(self._channel)

    def _watch(self) -> None:
        while not self._stop.wait(self.settings.retry_s):
            with self._lock:
                self._check_region()

    def _check_region(self) -> None:
        if self._stop.is_set():
            return
        if self._lease is not None:
            if not self._lease.alive():
                log.warning("kvbm worker %s ended our region (restarted?); re-registering", self.worker_id)
                self._drop_lease()
                self._backoff.reset()
            else:
                try:
                    status = self._stub.Status(pb.WorkerStatusRequest(), timeout=self.settings.timeout_s)
                except grpc.RpcError as exc:
                    self._lost(exc.code())
                    return
                if region_digest(self._lease.region_id) in {r.digest for r in status.regions}:
                    return
                log.warning("kvbm worker %s no longer lists our region; re-registering", self.worker_id)
                self._drop_lease()
                self._backoff.reset()
        self._ensure_region()
