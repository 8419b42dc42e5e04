"""Layer-pipelined loads on the engine's side: a ``TransferLayers`` call read on a helper thread.

Runs in an engine worker process. The worker daemon copies a load's blocks group by group in
page (layer) order and streams how many leading pages of every block landed
(``TransferProgress.pages_landed``); the engine's forward of layer L waits only until L's
pages landed (:meth:`LayerwiseCall.wait_pages`, called from vLLM's ``wait_for_layer_load``).

Invariants:
* ``wait_pages`` never waits past the time it is given; it returns False when the pages did
  not land by then or the call failed, and the caller then counts the whole load as failed;
* only the final message (``done``) vouches for the bytes: pages that landed before a failure
  were read by the forward, and the load is still a failure (the engine recomputes it);
* with a word on the engine's signal page (:class:`GpuWait`), ``wait_pages`` enqueues the
  wait on the forward's CUDA stream instead (the daemon writes the word after each group's
  copies) and returns at once; the word is released (every GPU wait of the load passes) when
  the outcome came and no copy can still land, and given back when the load settled;
* a call is also a :class:`~.transfers.TransferFuture` (``done``/``result``/
  ``add_done_callback``), so the tracker settles it like a ``Transfer`` future: ``result()``
  returns the ``TransferResponse`` or raises the call's ``grpc.RpcError``.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import grpc

from ...contract import pb
from ...signal_page import EngineSignals, Signal

log = logging.getLogger("kvbm.connector")

#: Threads that read progress streams (one per load in flight; a load's reader ends with it).
#: NOTE: beyond this many loads in flight at once, a load's progress is read only once a reader
#: is free: its layers then wait longer (for its outcome at worst), never past its deadline.
READER_THREADS = 256


class StreamEnded(grpc.RpcError):
    """The daemon closed a progress stream without an outcome (an older daemon, or a bug)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNKNOWN

    def details(self) -> str:
        return "the worker daemon ended a TransferLayers stream without the job's outcome"


@dataclass
class GpuWait:
    """A load's word on the engine's signal page (:mod:`kvbm_client.signal_page`): the layer
    waits go on the GPU. ``failure_settled(exc)``: on a failed call, whether no copy of the
    load can still land (the daemon answered, or it was stopped); only then may the reader
    release the word, else the engine's thread does once it settled the load. ``stream()``: the
    handle of the CUDA stream the forward runs on. ``gpu_from``: the waits for pages ending at
    or before it stay on the CPU (``gpu_layer_waits`` tail; 0: every wait on the GPU)."""

    signals: EngineSignals
    signal: Signal
    failure_settled: Callable[[BaseException], bool]
    stream: Callable[[], int]
    answer_by: float  # CLOCK_MONOTONIC: the GPU waits give up then (the load has failed by then)
    gpu_from: int = 0


class LayerwiseCall:
    """One ``TransferLayers`` call: the pages landed so far, and the outcome to come.

    Args:
        stream: the call's response iterator (a ``grpc`` rendezvous: also cancellable).
        readers: the pool whose thread reads it.
        gpu: the load's word, for waits on the GPU (None: the CPU waits).
    """

    def __init__(self, stream: Iterator["pb.TransferProgress"], readers: ThreadPoolExecutor,
                 gpu: GpuWait | None = None) -> None:
        self._stream = stream
        self._cond = threading.Condition(threading.RLock())
        self.pages_landed = 0
        self.pages_per_block = 0
        #: (monotonic seconds, pages landed) per progress message, for tracing
        self.landings: list[tuple[float, int]] = []
        self._outcome: Future[Any] = Future()
        self.gpu = gpu
        self.gpu_waits = 0  # waits enqueued on the GPU
        self._released = self._given_back = False
        readers.submit(self._read)

    def _read(self) -> None:
        try:
            for message in self._stream:
                if message.HasField("done"):
                    with self._cond:  # the outcome and the wake-up together: no waiter misses it
                        self._land(message.pages_per_block, message.pages_per_block)
                        self._outcome.set_result(message.done)
                    self.release()  # every byte landed
                    return
                self._land(message.pages_landed, message.pages_per_block)
            raise StreamEnded()
        except grpc.RpcError as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001 - a broken reader must not leave a waiter hanging
            self._fail(exc)
        if self.gpu is not None and self.gpu.failure_settled(self._outcome.exception() or StreamEnded()):
            self.release()

    def release(self) -> None:
        """Satisfy the GPU waits of this load (idempotent; see :class:`GpuWait` for when)."""
        with self._cond:
            if self.gpu is None or self._released:
                return
            self._released = True
        self.gpu.signals.release(self.gpu.signal)

    def end_signal(self) -> None:
        """The load settled (after any stop of an unanswering daemon): release its word and
        give it back (idempotent)."""
        self.release()
        with self._cond:
            if self.gpu is None or self._given_back:
                return
            self._given_back = True
        self.gpu.signals.give_back(self.gpu.signal)

    def _land(self, pages: int, per_block: int) -> None:
        with self._cond:  # (re-entrant: also called under it)
            self.pages_per_block = per_block
            if pages > self.pages_landed:
                self.pages_landed = pages
                self.landings.append((time.monotonic(), pages))
            self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if not self._outcome.done():
                self._outcome.set_exception(exc)
            self._cond.notify_all()

    # ------------------------------------------------------------------ the engine's waits
    def wait_pages(self, end: int, pages_per_block: int, until: float) -> bool:
        """Wait until every block's first ``end`` of ``pages_per_block`` pages landed, the call
        failed, or ``until`` (CLOCK_MONOTONIC) passed; whether the pages landed (a successful
        outcome counts as all of them)."""
        with self._cond:
            if self._covered(end, pages_per_block):
                return True
            if self._outcome.done():
                return self._outcome.exception() is None
            gpu = self.gpu if self.pages_per_block in (0, pages_per_block) else None
        if gpu is not None and end > gpu.gpu_from and self._wait_on_gpu(gpu, end):
            return True
        with self._cond:
            while True:
                if self._covered(end, pages_per_block):
                    return True
                if self._outcome.done():
                    return self._outcome.exception() is None
                left = until - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    def _wait_on_gpu(self, gpu: GpuWait, end: int) -> bool:
        """Enqueue the wait on the forward's stream; False (the CPU waits) if the driver refused."""
        try:
            gpu.signals.wait(gpu.signal, end, gpu.stream(), max(0.0, gpu.answer_by - time.monotonic()))
        except RuntimeError as exc:
            log.warning("kvbm: a layer wait on the GPU failed (%s); this load's layers wait on the CPU", exc)
            self.gpu = None
            self.release()
            return False
        self.gpu_waits += 1
        return True

    def _covered(self, end: int, pages_per_block: int) -> bool:
        if self.pages_per_block and self.pages_per_block != pages_per_block:
            return False  # another page count than the engine's: only the outcome counts
        return self.pages_landed >= end

    # ------------------------------------------------------------------ TransferFuture
    def done(self) -> bool:
        return self._outcome.done()

    def result(self, timeout: float | None = None) -> Any:
        return self._outcome.result(timeout)

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        self._outcome.add_done_callback(lambda _f: fn(self))

    def cancel(self) -> bool:
        cancel = getattr(self._stream, "cancel", None)
        return bool(cancel()) if callable(cancel) else False
