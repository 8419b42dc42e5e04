"""Worker role of the vLLM connector: hands the engine's KV memory to this GPU's (or CPU
rank's) worker daemon and asks it to move blocks on the leader's signed plans.

Runs in a vLLM worker process. Stores start in ``wait_for_save`` (the step's KV is written)
and are awaited at the start of the next step (``handle_preemptions`` /
``bind_connector_metadata``), before any block can be rewritten; finished requests whose
stores were in flight are reported in ``finished_sending`` so vLLM frees their blocks only
then. Loads start in ``start_load_kv`` and complete in ``get_finished``. A worker daemon that
is down turns loads into load errors (vLLM recomputes) and stores into skips; the region is
re-registered when the daemon is back.

A synchronous load (``LoadSpec.sync``) is waited for in ``start_load_kv``, before the step's
forward is enqueued; the daemon's reply comes after its copy stream finished, so the forward
reads loaded pages. An asynchronous one is reported in ``finished_recving`` by the first
``get_finished`` that finds it done (never waited for there: other requests' steps go on).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from ...channels import open_channel
from ...contract import pb, rpc
from ...regions import LayerSpec, RegionSpec
from .metadata import KvbmConnectorMetadata
from .settings import Backoff, ConnectorSettings

log = logging.getLogger("kvbm.connector")
TRACE = os.environ.get("KVBM_CONNECTOR_TRACE", "")


def trace(what: str, **fields) -> None:
    """One JSON line per event to ``$KVBM_CONNECTOR_TRACE`` (benchmarks: where the time goes)."""
    import json
    with open(TRACE, "a") as f:
        f.write(json.dumps({"what": what, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")


@dataclass
class InFlight:
    future: grpc.Future
    req_ids: list[str]
    engine_blocks: list[int]
    submitted: float  # time.monotonic() when sent (0 for a load never sent)


def region_from_kv_caches(kv_caches: dict, shm_path: str | None, base_tensor) -> RegionSpec | None:
    """Describe vLLM's per-layer KV views as a region over one shared buffer, or None when the
    buffer is not in shared memory (then the daemon cannot map it)."""
    if shm_path is None or base_tensor is None:
        return None
    base = base_tensor.untyped_storage().data_ptr()
    size = base_tensor.untyped_storage().nbytes()
    layers: list[LayerSpec] = []
    page = num_blocks = None
    dtype = ""
    for name, t in kv_caches.items():
        if t.untyped_storage().data_ptr() != base:
            log.warning("kvbm: layer %s is not in the shared KV buffer; kvbm disabled", name)
            return None
        if not t[0].is_contiguous():
            log.warning("kvbm: layer %s pages are not contiguous; kvbm disabled", name)
            return None
        this_page = t[0].numel() * t.element_size()
        if page not in (None, this_page) or num_blocks not in (None, t.shape[0]):
            log.warning("kvbm: layers differ in page size or block count; kvbm disabled")
            return None
        page, num_blocks, dtype = this_page, t.shape[0], str(t.dtype).replace("torch.", "")
        layers.append(LayerSpec(0, t.data_ptr() - base, t.stride(0) * t.element_size()))
    if not layers:
        return None
    return RegionSpec((shm_path,), (size,), tuple(layers), page, num_blocks, dtype,
                      engine_id=f"vllm-{os.getpid()}")


class KvbmConnectorWorker:
    def __init__(self, worker_id: str, settings: ConnectorSettings) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self.address = settings.worker_address(worker_id)
        self.spec: RegionSpec | None = None
        self.region_id: str | None = None
        self._channel = open_channel(self.address, self.settings.config)
        self._stub = rpc.WorkerStub(self._channel)
        self._backoff = Backoff(settings.retry_s)
        self._stores: list[InFlight] = []
        self._loads: dict[str, InFlight] = {}
        self._load_errors: set[int] = set()
        self._awaiting_send: set[str] = set()
        self._pending_store_reqs: dict[str, int] = {}
        self._lock = threading.Lock()  # region and channel, shared with the watchdog
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="kvbm-region-watchdog", daemon=True)
        self.cuda = False
        self._store_thread: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ region
    def set_region(self, spec, cuda: bool = False) -> None:
        """``spec``: a :class:`RegionSpec` (CPU, shm) or a ``CudaRegionSpec`` (GPU, CUDA IPC)."""
        self.spec = spec
        self.cuda = cuda
        if spec is None:
            log.warning("kvbm: the engine's KV cache is not shareable with the worker daemon; "
                        "serving without kvbm")
            return
        if cuda:
            self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="kvbm-store")
        with self._lock:
            if self._ensure_region():
                self._wait_pools()
        if not self._watchdog.is_alive():
            self._watchdog.start()

    def _wait_pools(self) -> None:
        """The daemon allocates (and on a GPU pins) its pools once it has our layout: wait for
        that (bounded by ``ready_timeout_s``) so the first requests' blocks are not skipped."""
        end = time.monotonic() + self.settings.ready_timeout_s
        while time.monotonic() < end:
            try:
                status = self._stub.Status(pb.WorkerStatusRequest(), timeout=self.settings.timeout_s)
            except grpc.RpcError:
                return
            if status.info.state == "ready":
                return
            time.sleep(0.1)
        log.warning("kvbm worker %s: pools not ready after %gs; starting anyway", self.worker_id,
                    self.settings.ready_timeout_s)

    def _ensure_region(self) -> bool:
        if self.region_id is not None:
            return True
        if self.spec is None or not self._backoff.ready():
            return False
        try:
            resp = self._stub.RegisterRegion(self.spec.to_request(), timeout=self.settings.timeout_s)
        except grpc.RpcError as exc:
            log.warning("kvbm worker %s (%s): %s; retrying in %gs", self.worker_id, self.address,
                        exc.details() or exc.code().name, self.settings.retry_s)
            self._backoff.failed()
            return False
        self.region_id = resp.region_id
        log.info("kvbm: engine KV cache registered with worker %s as %s", self.worker_id, self.region_id)
        return True

    def _lost(self, exc: grpc.RpcError) -> None:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
            if self.region_id is not None:
                log.warning("kvbm worker %s lost (%s); will re-register", self.worker_id, exc.code().name)
            self.region_id = None
            self._backoff.failed()
            if exc.code() == grpc.StatusCode.UNAVAILABLE:  # dial a restarted daemon afresh
                self._channel.close()
                self._channel = open_channel(self.address, self.settings.config)
                self._stub = rpc.WorkerStub(self._channel)

    # ------------------------------------------------------------------ transfers
    def _submit(self, plan: bytes, signature: bytes, blocks: list[int]) -> grpc.Future | None:
        with self._lock:
            if not self._ensure_region():
                return None
        request = pb.TransferRequest(region_id=self.region_id, plan=pb.SignedPlan(plan=plan, signature=signature),
                                     engine_blocks=blocks, sent_at=time.time())
        return self._stub.Transfer.future(request, timeout=max(self.settings.timeout_s, 30.0))

    def start_loads(self, meta: KvbmConnectorMetadata) -> None:
        sync: list[tuple[str, InFlight]] = []
        for spec in meta.loads:
            future = self._submit(spec.plan, spec.signature, spec.engine_blocks)
            if future is None:
                self._load_errors.update(spec.engine_blocks)
                item = InFlight(_done_future(), [spec.req_id], [], 0.0)
            else:
                item = InFlight(future, [spec.req_id], spec.engine_blocks, time.monotonic())
            if spec.sync:
                sync.append((spec.req_id, item))
            else:
                self._loads[spec.req_id] = item
        for req_id, item in sync:  # all submitted first: one daemon call per request, in parallel
            self._settle_load(req_id, item, "sync")

    def _settle_load(self, req_id: str, item: InFlight, mode: str) -> None:
        answer = None
        try:
            answer = item.future.result()
        except grpc.RpcError as exc:
            log.warning("kvbm load for %s failed (%s); vLLM recomputes it", req_id, exc.details())
            self._load_errors.update(item.engine_blocks)
            with self._lock:
                self._lost(exc)
        except Exception as exc:  # cancelled with a replaced channel
            log.warning("kvbm load for %s failed (%r); vLLM recomputes it", req_id, exc)
            self._load_errors.update(item.engine_blocks)
        if TRACE and item.engine_blocks:
            daemon = {} if not isinstance(answer, pb.TransferResponse) else {
                "joined": answer.joined, "copy_ms": round(answer.seconds * 1e3, 2),
                "in_daemon_ms": round(answer.waited_seconds * 1e3, 2),
                "transit_ms": round(answer.transit_seconds * 1e3, 2)}
            trace("load", req=req_id, blocks=len(item.engine_blocks), mode=mode,
                  submit_to_done_ms=round((time.monotonic() - item.submitted) * 1e3, 2), **daemon)

    def start_stores(self, meta: KvbmConnectorMetadata) -> None:
        if not meta.stores:
            return
        event = None
        if self.cuda:
            # Asynchronous scheduling (vLLM 0.26 on a GPU): this step's forward is only enqueued.
            # The daemon may read its blocks once the compute stream passed this event; a helper
            # thread waits for it and sends the plan, so the engine's thread never blocks here.
            import torch
            event = torch.cuda.Event()
            event.record()
        for spec in meta.stores:
            if event is not None:
                future = self._store_thread.submit(self._store_after, event, spec)
            else:
                future = self._submit(spec.plan, spec.signature, spec.engine_blocks)
            if future is None:
                continue
            self._stores.append(InFlight(future, spec.req_ids, spec.engine_blocks, time.monotonic()))
            for req_id in spec.req_ids:
                self._pending_store_reqs[req_id] = self._pending_store_reqs.get(req_id, 0) + 1

    def _store_after(self, event, spec):
        event.synchronize()
        future = self._submit(spec.plan, spec.signature, spec.engine_blocks)
        return future.result() if future is not None else None

    def fence_if_needed(self, meta) -> None:
        """Blocks of stores in flight stay allocated (running requests own them; finished ones
        are freed only after ``finished_sending``) except after a preemption: fence then."""
        if isinstance(meta, KvbmConnectorMetadata) and meta.fence:
            self.fence_stores()

    def fence_stores(self) -> None:
        """Wait for every store in flight: its blocks may be handed to other requests now."""
        for item in self._stores:
            self._settle_store(item)
        self._stores.clear()

    def _settle_store(self, item: InFlight) -> None:
        try:
            item.future.result()
        except grpc.RpcError as exc:
            log.warning("kvbm store of %d blocks failed: %s", len(item.engine_blocks), exc.details())
            with self._lock:
                self._lost(exc)
        except Exception as exc:  # cancelled with a replaced channel: a failed store, no more
            log.warning("kvbm store of %d blocks failed: %r", len(item.engine_blocks), exc)
        for req_id in item.req_ids:
            left = self._pending_store_reqs.get(req_id, 0) - 1
            if left > 0:
                self._pending_store_reqs[req_id] = left
            else:
                self._pending_store_reqs.pop(req_id, None)

    def finished(self, meta: KvbmConnectorMetadata | None) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving) for vLLM's ``get_finished``."""
        recving: set[str] = set()
        for req_id, item in list(self._loads.items()):
            if not item.future.done():
                continue  # reported by a later step's get_finished
            self._settle_load(req_id, item, "async")
            recving.add(req_id)
            del self._loads[req_id]
        if meta is not None:
            self._awaiting_send.update(meta.delayed_frees)
        # Settle stores that are already done so their requests' blocks can be freed.
        still = []
        for item in self._stores:
            if item.future.done():
                self._settle_store(item)
            else:
                still.append(item)
        self._stores = still
        sending = {r for r in self._awaiting_send if r not in self._pending_store_reqs}
        self._awaiting_send -= sending
        return (sending or None), (recving or None)

    def _watch(self) -> None:
        """Every ``retry_s``, also while the engine is idle: make sure the daemon still holds
        our region. A daemon that was restarted (kill -9, upgrade) has none, and the leader
        needs our layout again before it can plan pools, so no failed transfer would tell us."""
        while not self._stop.wait(self.settings.retry_s):
            with self._lock:
                self._check_region()

    def _check_region(self) -> None:
        if self.region_id is not None:
            try:
                status = self._stub.Status(pb.WorkerStatusRequest(), timeout=self.settings.timeout_s)
            except grpc.RpcError as exc:
                self._lost(exc)
                return
            if status.region_id == self.region_id:
                return
            log.warning("kvbm worker %s no longer holds our region (restarted?); re-registering", self.worker_id)
            self.region_id = None
            self._backoff.reset()
        self._ensure_region()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._stop.set()
        self.fence_stores()
        if self._store_thread is not None:
            self._store_thread.shutdown(wait=True)
        if self.region_id is not None:
            try:
                self._stub.UnregisterRegion(pb.UnregisterRegionRequest(region_id=self.region_id), timeout=2)
            except grpc.RpcError:
                pass
            self.region_id = None
        self._channel.close()


class _DoneFuture:
    def result(self, timeout=None):
        return None

    def done(self) -> bool:
        return True


def _done_future() -> _DoneFuture:
    return _DoneFuture()
