"""The engine-independent worker side of a kvbm connector: moves a step's blocks.

Runs in an engine worker process (one per GPU / tensor-parallel rank), on the engine's
thread. Composes a :class:`~.region_link.RegionLink` (the daemon, the registered region)
and a :class:`~.transfers.TransferTracker` (what is in flight). An engine adapter calls,
per step:

1. :meth:`WorkerCore.fence` when the step's plan says so (a preempted request's blocks may
   be rewritten by this step's forward: stores that read them must be done first);
2. :meth:`WorkerCore.start_loads` before the forward (synchronous loads are waited for
   there: the daemon answers after its copy finished, so the forward reads loaded pages);
3. :meth:`WorkerCore.start_stores` once the step's KV is written (or with ``ready``, a
   wait for that, run on a helper thread: vLLM 0.26 on a GPU returns before the forward ran);
4. :meth:`WorkerCore.finished` and :meth:`WorkerCore.take_load_errors` (never wait).

A daemon that is down turns loads into load errors (the engine recomputes) and stores into
skips; the region is registered again when the daemon is back.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

from ...contract import pb
from ...ids import EngineBlockId, WorkerId
from ...regions import RegionSpecLike
from .region_link import RegionLink
from .settings import ConnectorSettings
from .specs import LoadSpec, RequestId, StoreSpec
from .tracing import trace, tracing
from .transfers import InFlight, TransferTracker

log = logging.getLogger("kvbm.connector")


class WorkerCore:
    """One worker side: its region link, its transfers, and the store thread (created the
    first time a store must wait for the engine's KV to be written)."""

    def __init__(self, worker_id: WorkerId, settings: ConnectorSettings, link: RegionLink | None = None) -> None:
        self.worker_id = worker_id
        self.link = link or RegionLink(worker_id, settings)
        self.tracker = TransferTracker(on_failure=self.link.failed, on_load_done=_trace_load)
        self._store_thread: ThreadPoolExecutor | None = None

    def set_region(self, spec: RegionSpecLike | None) -> None:
        """Register the engine's KV memory (None: it cannot be shared; serve without kvbm)."""
        if spec is None:
            log.warning("kvbm: the engine's KV cache is not shareable with the worker daemon; serving without kvbm")
            return
        self.link.register(spec)

    # ------------------------------------------------------------------ loads
    def start_loads(self, loads: Sequence[LoadSpec], wait: bool = True) -> None:
        """Send every load of the step (one daemon call each, all in parallel); with ``wait``,
        also wait for the synchronous ones (else call :meth:`wait_loads` before the forward)."""
        for spec in loads:
            future = self.link.submit(spec.plan, spec.signature, spec.engine_blocks)
            self.tracker.load_sent(spec.req_id, future, spec.engine_blocks, spec.sync)
        if wait:
            self.wait_loads()

    def wait_loads(self) -> None:
        """Wait for the synchronous loads sent; failed ones are in :meth:`take_load_errors`."""
        self.tracker.settle_sync_loads()

    def take_load_errors(self) -> set[EngineBlockId]:
        """Engine block ids whose load failed since the last call."""
        return self.tracker.take_load_errors()

    # ------------------------------------------------------------------ stores
    def start_stores(self, stores: Sequence[StoreSpec], ready: Callable[[], None] | None = None) -> None:
        """Send the step's stores; with ``ready`` (blocks until the step's KV is written), a
        helper thread waits for it and sends them, so the engine's thread never blocks here."""
        for spec in stores:
            future: Any
            if ready is not None:
                future = self._thread().submit(self._store_after, ready, spec)
            else:
                future = self.link.submit(spec.plan, spec.signature, spec.engine_blocks)
            if future is not None:
                self.tracker.store_sent(future, spec.engine_blocks, spec.req_ids)

    def _thread(self) -> ThreadPoolExecutor:
        if self._store_thread is None:
            self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="kvbm-store")
        return self._store_thread

    def _store_after(self, ready: Callable[[], None], spec: StoreSpec) -> "pb.TransferResponse | None":
        ready()
        future = self.link.submit(spec.plan, spec.signature, spec.engine_blocks)
        return future.result() if future is not None else None

    def fence(self) -> None:
        """Wait for every store in flight."""
        self.tracker.fence()

    # ------------------------------------------------------------------ step end
    def finished(self, delayed_frees: Iterable[RequestId] = ()) -> tuple[set[RequestId], set[RequestId]]:
        """``(finished sending, finished loading)`` request ids; never waits."""
        return self.tracker.finished(delayed_frees)

    def shutdown(self) -> None:
        """Wait for the stores in flight, stop the store thread, unregister; idempotent."""
        self.tracker.fence()
        if self._store_thread is not None:
            self._store_thread.shutdown(wait=True)
            self._store_thread = None
        self.link.close()


def _trace_load(req_id: RequestId, item: InFlight, answer: Any, mode: str) -> None:
    if not tracing() or not item.engine_blocks:
        return
    daemon = {} if not isinstance(answer, pb.TransferResponse) else {
        "joined": answer.joined, "copy_ms": round(answer.seconds * 1e3, 2),
        "in_daemon_ms": round(answer.waited_seconds * 1e3, 2),
        "transit_ms": round(answer.transit_seconds * 1e3, 2)}
    trace("load", req=req_id, blocks=len(item.engine_blocks), mode=mode,
          submit_to_done_ms=round((time.monotonic() - item.submitted) * 1e3, 2), **daemon)

