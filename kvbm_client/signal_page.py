"""The engine's signal page: GPU-side layer waits for layer-pipelined loads.

Runs in an engine worker process (the connector's worker role), on a GPU. The engine owns a
sealed memfd of :data:`~.contract.SIGNAL_PAGE_BYTES` (:data:`~.contract.SIGNAL_SLOTS` uint32
words), maps it, registers it with CUDA and hands it to the worker daemon with its region
(:class:`SignalledRegion`; ``RegisterRegionRequest.signals``). A load takes a word
(:meth:`EngineSignals.take`: a slot and a fresh ``base``) and names it in its
``TransferRequest``; the daemon writes ``base + pages landed`` there after each layer group's
copies, on its copy stream. The forward of layer L then needs no CPU wait: the engine enqueues
``cuStreamWaitValue32(word >= base + end of L's pages)`` on its own stream
(:meth:`EngineSignals.wait`) and goes on launching kernels; the GPU runs layer L once its
pages landed.

Invariants:
* values only grow per word: a word's ``base`` is ``seq * SPAN`` with ``seq`` counting the
  word's loads from 1, and every value of a load lies in ``[base, base + SPAN)`` (``SPAN``
  > the pages per block), so a stale value of an earlier load never satisfies a later wait;
* a word is released (:meth:`EngineSignals.release`: ``base + SPAN - 1``, above every wait of
  its load) once the load's outcome is known and no copy of it can still land: the daemon
  answered, or it was stopped; never while a copy may still write the load's blocks. The
  forward that ran over a failed load's pages is discarded as before (the load counts as
  failed, vLLM recomputes);
* a word is reused only after its load settled (:meth:`EngineSignals.give_back`).
Everything CUDA is imported lazily (a CPU engine never enables GPU waits).
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .contract import SIGNAL_PAGE_BYTES, SIGNAL_SLOTS, pb
from .regions import LayerSpec, RegionSpecLike, sealed_memfd

log = logging.getLogger("kvbm.connector")

#: the values of one load of a word: ``[base, base + SPAN)`` (pages per block must stay below)
SPAN = 1024
#: the last ``seq`` a word may take (its values must fit 32 bits)
MAX_SEQ = (1 << 32) // SPAN - 1


@dataclass(frozen=True, slots=True)
class Signal:
    """One load's word: ``TransferRequest.signal_slot = slot + 1``, ``signal_base = base``."""

    slot: int
    base: int


class EngineSignals:
    """The page, its words' allocation, and the GPU waits (see the module docstring). Thread
    safe: words are taken on the engine's thread and released on a progress reader's."""

    def __init__(self) -> None:
        self.fd = sealed_memfd(f"kvbm-signals-{os.getpid()}", SIGNAL_PAGE_BYTES)
        try:
            self._map = mmap.mmap(self.fd, SIGNAL_PAGE_BYTES, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.words = np.frombuffer(self._map, dtype="<u4")
        self._seq = [0] * SIGNAL_SLOTS
        self._free: deque[int] = deque(range(SIGNAL_SLOTS))
        self._lock = threading.Lock()
        self.device_ptr: int | None = None
        self._driver: Any = None

    # ------------------------------------------------------------------ CUDA
    def enable_gpu(self, device: int) -> str | None:
        """Register the page with CUDA on ``device`` for stream waits; returns why not (None: on)."""
        try:
            from cuda.bindings import driver, runtime
        except ImportError as exc:
            return f"cuda-python is not installed ({exc})"
        try:
            ok = runtime.cudaError_t.cudaSuccess
            addr = int(self.words.ctypes.data)
            flags = runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterPortable
            err = runtime.cudaHostRegister(addr, SIGNAL_PAGE_BYTES, flags)[0]
            if err != ok:
                return f"cudaHostRegister: {getattr(err, 'name', err)}"
            err, ptr = runtime.cudaHostGetDevicePointer(addr, 0)
            if err != ok:
                runtime.cudaHostUnregister(addr)
                return f"cudaHostGetDevicePointer: {getattr(err, 'name', err)}"
        except Exception as exc:  # noqa: BLE001 - a driver without these calls: CPU waits
            return f"{type(exc).__name__}: {exc}"
        self.device_ptr, self._driver = int(ptr), driver
        try:  # NOTE: a probe, not CAN_USE_STREAM_MEM_OPS_V1 (0 on CUDA 12+, whose v2 operations always exist)
            import torch
            stream = torch.cuda.Stream(device)
            self.wait(Signal(0, 0), 0, int(stream.cuda_stream))  # word 0 >= 0: passes at once
            stream.synchronize()
        except Exception as exc:  # noqa: BLE001
            self.close_gpu()
            return f"a stream wait on the signal page failed: {exc}"
        return None

    def close_gpu(self) -> None:
        """Undo :meth:`enable_gpu` (the page stays mapped; waits go back to the CPU)."""
        if self.device_ptr is not None:
            from cuda.bindings import runtime
            runtime.cudaHostUnregister(int(self.words.ctypes.data))
            self.device_ptr, self._driver = None, None

    @property
    def on_gpu(self) -> bool:
        return self.device_ptr is not None

    def wait(self, signal: Signal, end: int, stream: int) -> None:
        """Enqueue on ``stream`` (a CUDA stream handle): wait until the word reaches
        ``base + end`` (every block's pages ``[0, end)`` landed, or the word was released).
        Raises RuntimeError when the driver refuses (the caller waits on the CPU instead)."""
        d = self._driver
        assert d is not None and self.device_ptr is not None, "GPU waits are not enabled"
        err = d.cuStreamWaitValue32(d.CUstream(stream), d.CUdeviceptr(self.device_ptr + 4 * signal.slot),
                                    signal.base + end, d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)[0]
        if err != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamWaitValue32: {getattr(err, 'name', err)}")

    # ------------------------------------------------------------------ words
    def take(self, pages_per_block: int) -> Signal | None:
        """A word for one load of ``pages_per_block`` pages (None: none free, or too many pages)."""
        if pages_per_block >= SPAN:
            return None
        with self._lock:
            for _ in range(len(self._free)):
                slot = self._free.popleft()
                if self._seq[slot] < MAX_SEQ:
                    self._seq[slot] += 1
                    return Signal(slot, self._seq[slot] * SPAN)
                # a worn-out word (MAX_SEQ loads) is never handed out again
        return None

    def release(self, signal: Signal) -> None:
        """Satisfy every wait of ``signal``'s load (a CPU store; see the invariants for when)."""
        self.words[signal.slot] = signal.base + SPAN - 1

    def give_back(self, signal: Signal) -> None:
        """``signal``'s load settled (and was released): its word may serve another load."""
        with self._lock:
            self._free.append(signal.slot)

    def close(self) -> None:
        self.close_gpu()
        self.words = np.zeros(0, np.uint32)
        try:
            self._map.close()
        except BufferError:
            pass
        os.close(self.fd)


class SignalledRegion:
    """A region spec (memfds or CUDA IPC) with the engine's signal page: its fd goes last."""

    def __init__(self, spec: RegionSpecLike, signals: EngineSignals) -> None:
        self.spec, self.signals = spec, signals

    @property
    def engine_id(self) -> str:
        return self.spec.engine_id

    @property
    def layers(self) -> "tuple[LayerSpec, ...]":
        return self.spec.layers

    @property
    def fds(self) -> Sequence[int]:
        return (*self.spec.fds, self.signals.fd)

    def to_request(self) -> "pb.RegisterRegionRequest":
        request = self.spec.to_request()
        request.signals.CopyFrom(pb.RegionBuffer(fd_index=len(self.spec.fds), size_bytes=SIGNAL_PAGE_BYTES,
                                                 device=-1))
        return request
