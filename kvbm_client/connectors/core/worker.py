"""The engine-independent worker side of a kvbm connector: moves a step's blocks.

Runs in an engine worker process (one per GPU / tensor-parallel rank), on the engine's
thread. Composes a :class:`~.region_link.RegionLink` (the daemon, the registered region)
and a :class:`~.transfers.TransferTracker` (what is in flight). An engine adapter calls,
per step:

1. :meth:`WorkerCore.fence` when the step's plan says so (a preempted request's blocks may
   be rewritten by this step's forward: stores that read them must be done first);
2. :meth:`WorkerCore.start_loads` before the forward (synchronous loads are waited for
   there: the daemon answers after its copy finished, so the forward reads loaded pages;
   layer-pipelined ones with ``wait=False``, then :meth:`WorkerCore.wait_pages` before each
   layer's forward and :meth:`WorkerCore.wait_loads` once the forward is enqueued);
3. :meth:`WorkerCore.start_stores` once the step's KV is written (or with ``ready``, a
   wait for that, run on a helper thread: vLLM 0.26 on a GPU returns before the forward ran);
   dropped when a synchronous load of the step (or of the ``overlapping_steps - 1`` before
   it) failed: the forward computed those blocks over pages that were never loaded, and the
   engine recomputes them;
4. :meth:`WorkerCore.finished` and :meth:`WorkerCore.take_load_errors` (never wait, except
   to stop a daemon that did not answer a load, see below).

Every call is waited for until the plan's deadline plus :data:`ANSWER_MARGIN_S`, not a fixed
time. A daemon that is down turns loads into load errors (the engine recomputes) and stores
into skips; the region is registered again when the daemon is back. A load the daemon did
not answer by then may still be written later by a stopped or frozen daemon: the worker side
kills that daemon (:class:`~.daemon_process.DaemonProcess`) before the load counts as failed
(the ordering argument is in :mod:`kvbm_client.connectors.core`).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import grpc

from ...contract import pb
from ...ids import EngineBlockId, WorkerId
from ...regions import RegionSpecLike
from ...signal_page import EngineSignals, SignalledRegion
from .daemon_process import DaemonProcess
from .layerwise import GpuWait, LayerwiseCall
from .region_link import RegionLink
from .settings import ConnectorSettings, gpu_waits_from
from .specs import LoadSpec, RequestId, StoreSpec
from .tracing import trace, tracing
from .transfers import InFlight, TransferFuture, TransferTracker, unanswered

log = logging.getLogger("kvbm.connector")

#: Seconds past a plan's deadline that its call is waited for. NOTE: a live daemon starts no
#: copy after the deadline and stops a running one at its next chunk, so it has answered by
#: then unless it is stopped or frozen; the margin covers its event loop and the answer's way.
ANSWER_MARGIN_S = 5.0
#: The wait for a call whose plan carries no deadline (an older leader).
NO_DEADLINE_WAIT_S = 30.0
#: Seconds to wait for a killed daemon to be gone.
KILL_WAIT_S = 5.0
#: Seconds an unanswering daemon gets to be seen exited (it died: no kill) before it is killed.
EXIT_GRACE_S = 0.2


def _current_stream() -> int:
    """The handle of the CUDA stream the engine's forward is enqueued on now."""
    import torch
    return int(torch.cuda.current_stream().cuda_stream)


def answer_by(deadline: float) -> float:
    """When a call for a plan with ``deadline`` stops being waited for (CLOCK_MONOTONIC)."""
    return deadline + ANSWER_MARGIN_S if deadline > 0 else time.monotonic() + NO_DEADLINE_WAIT_S


class WorkerCore:
    """One worker side: its region link, its transfers, the daemon's process (held only to
    stop it when it does not answer a load), and the store thread (created the first time a
    store must wait for the engine's KV to be written).

    Args:
        overlapping_steps: how many steps the engine runs at once (2 with vLLM's asynchronous
            scheduling: a step is scheduled before the previous step's failed loads are known,
            so its forward may compute over them too).
    """

    def __init__(self, worker_id: WorkerId, settings: ConnectorSettings, link: RegionLink | None = None,
                 overlapping_steps: int = 1) -> None:
        self.worker_id = worker_id
        self.link = link or RegionLink(worker_id, settings)
        self.daemon = DaemonProcess(settings.worker_address(worker_id))
        self._exit_told = 0  # the pid of the last daemon whose exit mid-load was logged
        self.tracker = TransferTracker(on_failure=self.link.failed, on_load_done=_trace_load,
                                       on_unanswered=self._stop_daemon)
        self.overlapping_steps = max(1, overlapping_steps)
        self._tainted_steps = 0  # steps whose stores are dropped (their forward read unloaded pages)
        self._store_thread: ThreadPoolExecutor | None = None
        self.signals: EngineSignals | None = None  # GPU layer waits (the page is on the GPU)
        self._gpu_waits = settings.gpu_layer_waits  # which layers' waits go on the GPU (see _gpu_wait)
        self._pages_per_block = 0

    def set_region(self, spec: RegionSpecLike | None, signals: EngineSignals | None = None) -> None:
        """Register the engine's KV memory (None: it cannot be shared; serve without kvbm);
        ``signals``: the engine's signal page, registered with it (layer waits on the GPU)."""
        if spec is None:
            log.warning("kvbm: the engine's KV cache is not shareable with the worker daemon; serving without kvbm")
            return
        self._pages_per_block = len(spec.layers)
        if signals is not None:
            self.signals = signals
            spec = SignalledRegion(spec, signals)
        self.link.register(spec)

    # ------------------------------------------------------------------ loads
    def start_loads(self, loads: Sequence[LoadSpec], wait: bool = True,
                    ready: Callable[[], None] | None = None) -> None:
        """Send every load of the step (one daemon call each, all in parallel); with ``wait``,
        also wait for the synchronous ones (else call :meth:`wait_loads` before the forward).
        ``ready``: called first when there are loads (blocks until nothing the engine enqueued
        before can still write their blocks). Called once per engine step, loads or not."""
        self._tainted_steps = max(0, self._tainted_steps - 1)
        if loads:
            if ready is not None:
                ready()
            self.daemon.learn()  # the process that may run these copies (a no-op while it runs)
        for spec in loads:
            due = answer_by(spec.deadline)
            future = self._submit(spec.plan, spec.signature, spec.engine_blocks, due, spec.layer_groups)
            self.tracker.load_sent(spec.req_id, future, spec.engine_blocks, spec.sync, due, self._resend(spec))
        if wait:
            self.wait_loads()

    def wait_pages(self, end: int, pages_per_block: int) -> None:
        """Before the forward of a layer whose pages end at ``end``: wait until every
        layer-pipelined load of the step landed them (see :meth:`TransferTracker.wait_sync_pages`)."""
        self.tracker.wait_sync_pages(end, pages_per_block)

    def wait_loads(self, forward_waited: bool = True) -> None:
        """Wait for the synchronous loads sent; failed ones are in :meth:`take_load_errors`,
        and this step's stores (and those of the overlapping steps) are dropped.
        ``forward_waited`` False: the forward did not wait for every page of the step's
        layer-pipelined loads (they fail)."""
        if self.tracker.settle_sync_loads(forward_waited):
            self._tainted_steps = self.overlapping_steps

    def _resend(self, spec: LoadSpec) -> Callable[[float], "TransferFuture | None"]:
        return lambda due: self._submit(spec.plan, spec.signature, spec.engine_blocks, due)

    def _submit(self, plan: bytes, signature: bytes, blocks: list[EngineBlockId],
                due: float, layer_groups: int = 0) -> "TransferFuture | None":
        gpu = self._gpu_wait(due, layer_groups) if layer_groups > 1 else None
        future = self.link.submit(plan, signature, blocks, timeout=max(0.1, due - time.monotonic()),
                                  layer_groups=layer_groups, gpu=gpu)
        if gpu is not None and not isinstance(future, LayerwiseCall):
            gpu.signals.give_back(gpu.signal)  # never sent: nothing writes or waits for it
        return future

    def _gpu_wait(self, due: float, layer_groups: int) -> GpuWait | None:
        """A word of the signal page for a layer-pipelined load in ``layer_groups`` groups
        answered by ``due`` (None: its layers wait on the CPU)."""
        signals = self.signals
        signal = signals.take(self._pages_per_block) if signals is not None and signals.on_gpu else None
        if signals is None or signal is None:
            return None
        gpu_from = gpu_waits_from(self._gpu_waits, self._pages_per_block, layer_groups)
        return GpuWait(signals, signal, lambda exc: self._failure_settled(exc, due), _current_stream, due, gpu_from)

    def _failure_settled(self, exc: BaseException, due: float) -> bool:
        """On a progress reader, for a failed layer-pipelined load: whether no copy of it can
        still land, stopping the daemon first when it did not answer (as :meth:`_stop_daemon`
        does on the engine's thread, which settles the load when this returns False)."""
        if not unanswered(exc, due, time.monotonic()):
            return True  # the daemon's own status: it answers after its copies stopped
        return self._held_daemon_gone()

    def _stop_daemon(self, item: InFlight) -> None:
        """A load got no answer by its deadline plus the margin: the daemon is stopped, frozen
        or gone, and a copy it resumes could land in the load's blocks after the engine gave
        them to another request. Return only once that cannot happen: the daemon's process
        is gone (killed if need be), or, without a process to hold, it answered again."""
        if not self._held_daemon_gone():
            self._wait_for_answer(item)

    def _held_daemon_gone(self) -> bool:
        """Whether the daemon's process we hold is gone, killed now if need be (False: no process
        is held, or it survived the kill). A daemon that died closes its connections a moment
        before the kernel reports it exited: it gets :data:`EXIT_GRACE_S` to be seen gone first."""
        if not self.daemon.held:
            return False
        if self.daemon.wait_gone(EXIT_GRACE_S):
            if self._exit_told != self.daemon.pid:  # once per process (the reader and the engine's thread ask)
                self._exit_told = self.daemon.pid
                log.warning("kvbm worker %s (pid %d) exited with a load in flight; no copy of it can land any more",
                            self.worker_id, self.daemon.pid)
            return True
        log.error("kvbm worker %s (pid %d) did not answer a load (its deadline passed, or its connection broke) "
                  "and still runs; killing it, so that no late copy lands in blocks the engine reuses (its "
                  "supervisor restarts it)", self.worker_id, self.daemon.pid)
        return self.daemon.kill(KILL_WAIT_S)

    def _wait_for_answer(self, item: InFlight) -> None:
        """No process to stop (a TCP address): ask again until the daemon answers (a second
        call of the same plan joins the job or returns its outcome) or refuses connections."""
        while item.retry is not None:
            log.error("kvbm worker %s did not answer a load and cannot be stopped from here; the engine waits "
                      "for it (a late copy must not land in reused blocks)", self.worker_id)
            due = time.monotonic() + ANSWER_MARGIN_S
            future = item.retry(due)
            if future is None:
                return  # no region: the daemon is gone (it answered UNAVAILABLE or NOT_FOUND)
            try:
                future.result()
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() < due:
                    return  # the daemon's word, or the connection refused: no copy runs

    def take_load_errors(self) -> set[EngineBlockId]:
        """Engine block ids whose load failed since the last call."""
        return self.tracker.take_load_errors()

    # ------------------------------------------------------------------ stores
    def start_stores(self, stores: Sequence[StoreSpec], ready: Callable[[], None] | None = None) -> None:
        """Send the step's stores; with ``ready`` (blocks until the step's KV is written), a
        helper thread waits for it and sends them, so the engine's thread never blocks here.
        Nothing is sent when a synchronous load failed in this step or an overlapping one
        (the plans expire at the leader; the blocks are not offered again)."""
        if self._tainted_steps and stores:
            log.warning("kvbm: a synchronous load of this step failed, so its forward read pages that were not "
                        "loaded; its %d store plans are dropped", len(stores))
            self.tracker.store_dropped(spec.store_id for spec in stores)
            return
        for spec in stores:
            future: Any
            if ready is not None:
                future = self._thread().submit(self._store_after, ready, spec)
            else:
                future = self._submit(spec.plan, spec.signature, spec.engine_blocks, answer_by(spec.deadline))
            if future is not None:
                self.tracker.store_sent(future, spec.engine_blocks, spec.req_ids, spec.store_id)
            else:
                self.tracker.store_dropped((spec.store_id,))

    def _thread(self) -> ThreadPoolExecutor:
        if self._store_thread is None:
            self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="kvbm-store")
        return self._store_thread

    def _store_after(self, ready: Callable[[], None], spec: StoreSpec) -> "pb.TransferResponse | None":
        ready()
        future = self._submit(spec.plan, spec.signature, spec.engine_blocks, answer_by(spec.deadline))
        return future.result() if future is not None else None

    def fence(self) -> None:
        """Wait for every store in flight."""
        self.tracker.fence()

    # ------------------------------------------------------------------ step end
    def finished(self, delayed_frees: Iterable[RequestId] = ()) -> tuple[set[RequestId], set[RequestId]]:
        """``(finished sending, finished loading)`` request ids; never waits."""
        return self.tracker.finished(delayed_frees)

    def settled_stores(self) -> list[int]:
        """Ids of the held stores settled since the last call (after :meth:`finished`), for the
        scheduler side's block holds (:mod:`.block_holds`)."""
        return self.tracker.take_settled_stores()

    def shutdown(self) -> None:
        """Wait for the stores in flight, stop the store thread, unregister; idempotent."""
        self.tracker.fence()
        if self._store_thread is not None:
            self._store_thread.shutdown(wait=True)
            self._store_thread = None
        self.link.close()
        self.daemon.close()


def _trace_load(req_id: RequestId, item: InFlight, answer: Any, mode: str) -> None:
    if not tracing() or not item.engine_blocks:
        return
    daemon: dict[str, Any] = {} if not isinstance(answer, pb.TransferResponse) else {
        "joined": answer.joined, "copy_ms": round(answer.seconds * 1e3, 2),
        "in_daemon_ms": round(answer.waited_seconds * 1e3, 2),
        "transit_ms": round(answer.transit_seconds * 1e3, 2)}
    landings = getattr(item.future, "landings", None)
    if landings:  # a layer-pipelined load: when each group's pages landed (ms after the submit)
        daemon["landed_ms"] = [round((t - item.submitted) * 1e3, 2) for t, _ in landings]
    if isinstance(item.future, LayerwiseCall):  # waits enqueued on the GPU (0: the CPU waited)
        daemon["gpu_waits"] = item.future.gpu_waits
    trace("load", req=req_id, blocks=len(item.engine_blocks), mode=mode,
          submit_to_done_ms=round((time.monotonic() - item.submitted) * 1e3, 2), **daemon)

