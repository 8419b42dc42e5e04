"""The engine's signal page: GPU-side layer waits for layer-pipelined loads.

Runs in an engine worker process (the connector's worker role), on a GPU. The engine owns a
sealed memfd of :data:`~.contract.SIGNAL_PAGE_BYTES` (:data:`~.contract.SIGNAL_SLOTS` uint32
words), maps it, registers it with CUDA and hands it to the worker daemon with its region
(:class:`SignalledRegion`; ``RegisterRegionRequest.signals``). A load takes a word
(:meth:`EngineSignals.take`: a slot and a fresh ``base``) and names it in its
``TransferRequest``; the daemon writes ``base + pages landed`` there after each layer group's
copies, with 4-byte DMAs ordered after those copies on the GPU. The forward of layer L then
needs no CPU wait: the engine enqueues a one-thread kernel that polls the word until
``base + end of L's pages`` (:meth:`EngineSignals.wait`) on its own stream and goes on
launching kernels; the GPU runs layer L once its pages landed.

Invariants:
* values only grow per word: a word's ``base`` is ``seq * SPAN`` with ``seq`` counting the
  word's loads from 1, and every value of a load lies in ``[base, base + SPAN)`` (``SPAN``
  > the pages per block), so a stale value of an earlier load never satisfies a later wait;
* a word is released (:meth:`EngineSignals.release`: ``base + SPAN - 1``, above every wait of
  its load) once the load's outcome is known and no copy of it can still land: the daemon
  answered, or it was stopped; never while a copy may still write the load's blocks. The
  forward that ran over a failed load's pages is discarded as before (the load counts as
  failed, vLLM recomputes). The wait kernel also gives up at the load's answer time (by which
  an unanswered load counts as failed and its daemon was stopped), so no GPU wait outlives it;
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
#: the wait kernel reads its word (host memory, over PCIe) every POLL_NS ns
POLL_NS = 2000


@dataclass(frozen=True, slots=True)
class Signal:
    """One load's word: ``TransferRequest.signal_slot = slot + 1``, ``signal_base = base``."""

    slot: int
    base: int


class EngineSignals:
    """The page, its words' allocation, and the GPU waits (see the module docstring). Thread
    safe: words are taken on the engine's thread and released on a progress reader's."""

    def __init__(self, poll_ns: int = POLL_NS) -> None:
        #: how long the wait kernel sleeps between two reads of its word (ns)
        self.poll_ns = poll_ns
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
        #: the wait kernel (CUfunction) once enable_gpu succeeded, with its PTX image and module
        #: (held as long as the function is used) and, per word, what it read last and how long
        #: it waited (``_seen``, a diagnostic on the device)
        self._image: bytes | None = None
        self._module: Any = None
        self._kernel: Any = None
        self._seen: Any = None

    # ------------------------------------------------------------------ CUDA
    def enable_gpu(self, device: int, lazy_loading: bool = False) -> str | None:
        """Register the page with CUDA on ``device`` and build the wait kernel; returns why
        not (None: GPU waits on). Run on the engine's thread (its CUDA context is current).
        ``lazy_loading``: also where CUDA loads kernels lazily (see the NOTE on the kernel)."""
        try:
            from cuda.bindings import driver, runtime
        except ImportError as exc:
            return f"cuda-python is not installed ({exc})"
        addr = int(self.words.ctypes.data)
        try:
            err, mode = driver.cuModuleGetLoadingMode()
        except Exception as exc:  # noqa: BLE001 - a cuda-python without it: the CPU waits
            return f"cuModuleGetLoadingMode: {type(exc).__name__}: {exc}"
        eager = err == driver.CUresult.CUDA_SUCCESS and mode == driver.CUmoduleLoadingMode.CU_MODULE_EAGER_LOADING
        if not eager and not lazy_loading:
            return ("CUDA loads kernels lazily and gpu_layer_waits is 'eager' (GPU layer waits: set "
                    "CUDA_MODULE_LOADING=EAGER, or gpu_layer_waits true)")
        try:
            ok = runtime.cudaError_t.cudaSuccess
            flags = runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterPortable
            err = runtime.cudaHostRegister(addr, SIGNAL_PAGE_BYTES, flags)[0]
            if err != ok:
                return f"cudaHostRegister: {getattr(err, 'name', err)}"
            self._driver = driver
            err, ptr = runtime.cudaHostGetDevicePointer(addr, 0)
            if err != ok:
                raise RuntimeError(f"cudaHostGetDevicePointer: {getattr(err, 'name', err)}")
            self.device_ptr = int(ptr)
            self._image, self._module, self._kernel = _wait_kernel(driver, device, self.poll_ns)
            import torch
            self._seen = torch.zeros(2 * SIGNAL_SLOTS, dtype=torch.int64, device=f"cuda:{device}")
            stream = torch.cuda.Stream(device)
            self.wait(Signal(0, 0), 0, int(stream.cuda_stream), 1.0)  # word 0 >= 0: returns at once
            stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - no NVRTC, an old driver ...: the CPU waits
            self.close_gpu()
            return f"{type(exc).__name__}: {exc}"
        return None

    def close_gpu(self) -> None:
        """Undo :meth:`enable_gpu` (the page stays mapped; waits go back to the CPU)."""
        if self._driver is not None:
            from cuda.bindings import runtime
            runtime.cudaHostUnregister(int(self.words.ctypes.data))
        self.device_ptr, self._driver = None, None
        self._image, self._module, self._kernel, self._seen = None, None, None, None

    @property
    def on_gpu(self) -> bool:
        return self._kernel is not None

    def wait(self, signal: Signal, end: int, stream: int, seconds: float) -> None:
        """Enqueue on ``stream`` (a CUDA stream handle): wait until the word reaches
        ``base + end`` (every block's pages ``[0, end)`` landed, or the word was released), or
        ``seconds`` passed since the wait began on the GPU (a safety net: the load's answer
        time, by which an unanswered load counts as failed anyway). A one-thread kernel that
        polls the word (host memory, mapped) every ``poll_ns``. Raises RuntimeError when the
        launch fails."""
        import ctypes
        d = self._driver
        assert d is not None and self.device_ptr is not None and self._kernel is not None, "GPU waits are not enabled"
        args = ((self.device_ptr + 4 * signal.slot, signal.base + end, max(0, int(seconds * 1e9)),
                 self._seen.data_ptr() + 16 * signal.slot),
                (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_void_p))
        err = d.cuLaunchKernel(self._kernel, 1, 1, 1, 1, 1, 1, 0, d.CUstream(stream), args, 0)[0]
        if err != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel (layer wait): {getattr(err, 'name', err)}")

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


#: NOTE: a kernel, not ``cuStreamWaitValue32``: stream memory operations hang the launching
#: thread on drivers that do not enable them (CAN_USE_STREAM_MEM_OPS_V1 = 0, measured on an
#: H200 VM, ``benchmarks/stream_wait_probe.py``); a one-thread kernel needs nothing of the driver.
#: NOTE: under lazy module loading (CUDA's default) the waits hold too: the launch of a kernel
#: whose module was not loaded yet holds the launching thread until the spinning wait ends (a
#: module load synchronizes the context), and the stream never passes the wait before its word,
#: which the daemon (another process) writes (H200, 2026-11-26 eighth session,
#: ``benchmarks/wait_kernel_probe.py``, ``tests/gpu/test_daemon_gpu.py``). ``enable_gpu`` still
#: refuses lazy loading unless asked (``gpu_layer_waits`` true, or tail, the default since the tenth
#: session, which puts only the last layers' waits there: see the README). The kernel reads with ``ld.global.cv`` (fetch again, never a cached
#: line) and records what it read (``_seen``: a diagnostic).
WAIT_KERNEL = r"""
extern "C" __global__ void kvbm_wait_word(const unsigned int* word, unsigned long long target64,
                                         unsigned long long max_ns, unsigned long long* seen) {
    unsigned int target = (unsigned int)target64, value = 0;
    unsigned long long start, now = 0, slept = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    while (true) {
        asm volatile("ld.global.cv.u32 %0, [%1];" : "=r"(value) : "l"(word) : "memory");
        *seen = value;  // (a store in the loop: without one the loop did not poll, see above)
        if ((int)(value - target) >= 0) break;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        // gives up only when both clocks say so: the timer, and the sleeps asked for
        if (now - start > max_ns && slept > max_ns) break;
        __nanosleep(POLL_NS);
        slept += POLL_NS;
    }
    seen[1] = now - start;
}
"""


def _wait_kernel(driver: Any, device: int, poll_ns: int = POLL_NS) -> tuple[bytes, Any, Any]:
    """Compile :data:`WAIT_KERNEL` with NVRTC for ``device`` (polling every ``poll_ns``) and load
    it into the current context: (the PTX image, the module, its function); keep all three."""
    from cuda.bindings import nvrtc
    err, major = driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                             device)
    err, minor = driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                             device)
    source = f"#define POLL_NS {int(poll_ns)}ULL\n{WAIT_KERNEL}"
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"kvbm_wait.cu", 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcCreateProgram: {err}")
    opts = [f"--gpu-architecture=compute_{major}{minor}".encode()]
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log_buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log_buf)
        raise RuntimeError(f"nvrtcCompileProgram: {log_buf.decode(errors='replace')}")
    _, size = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * size
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(prog)
    err, module = driver.cuModuleLoadData(ptx)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuModuleLoadData: {getattr(err, 'name', err)}")
    err, function = driver.cuModuleGetFunction(module, b"kvbm_wait_word")
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuModuleGetFunction: {getattr(err, 'name', err)}")
    return ptx, module, function
