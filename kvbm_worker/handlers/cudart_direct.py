"""The copy lane's CUDA runtime calls made straight through ``ctypes``: ``cudaMemcpyBatchAsync``
over numpy arrays, and the events that mark a piece. A load's call keeps the interpreter lock; a
store's, and each share of a load split among threads (:mod:`.issuers`), gives it up
(``batch(release=True)``: a store must not hold up the load lane, 2026-11-27 twenty-first session).

Why: cuda-python's binding builds a Python object per copy and releases the lock around every
call (as torch's event record does), so a piece cost the lane several lock hand-offs and ~1 µs
of Python per copy. Here a load's piece is one foreign call that keeps the lock (``ctypes.PyDLL``),
the addresses handed over as the arrays' memory; ``synchronize`` (it blocks) and the releasing
batch call (``ctypes.CDLL``: stores, split loads) give it up.
Measured on an H200 beside vLLM (2026-11-26, ``README`` "seventh session"): the lane's CPU time
issuing an 8K load's pieces 9.4-13.6 ms instead of 19.3-21.1, its first layer group at the engine
~4.5 ms sooner. The per-piece CPU time equals its wall time on both paths, so what the lane
spends is CPU in the call, not waiting for the lock. That the call cost ~2.5x more CPU beside vLLM
than alone is explained (twentieth session, 2026-11-27): vLLM 0.26's V2 runner allocates each layer
apart, so a block is a copy per layer (36) where the benchmarks' cross-layer cache made it one;
the driver's cost is per copy (:mod:`.issuers` issues such loads from several threads).
NOTE: the daemon's event loop cannot run while a piece is issued (up to ~3.5 ms for a 418-copy
piece beside vLLM); it took a landed group's news 0.1-0.2 ms after the lane there
(``results/worker_debug_h200_2026-11-26g.txt``).

Loaded from the ``libcudart`` that torch already mapped into the process (the runtime the
daemon's streams belong to). :func:`load` returns None where that library or the batch API is
missing, and :func:`checked` also where a check copy through it does not move exactly the bytes
it names; the copier then keeps cuda-python (logged).
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger("kvbm.worker")

NOT_READY = 600  # cudaErrorNotReady
BATCH_MAX = 4096  # copies per cudaMemcpyBatchAsync call (the copiers' cut)
DISABLE_TIMING = 0x2  # cudaEventDisableTiming
SRC_ACCESS_ORDER_STREAM = 0x1  # cudaMemcpySrcAccessOrderStream
PREFER_OVERLAP_WITH_COMPUTE = 0x1  # cudaMemcpyFlagPreferOverlapWithCompute
_VOID_PP = ctypes.POINTER(ctypes.c_void_p)
_SIZE_P = ctypes.POINTER(ctypes.c_size_t)
MAPS = Path("/proc/self/maps")


class MemLocation(ctypes.Structure):
    """``cudaMemLocation`` (CUDA 12.8+ ``{cudaMemLocationType type; int id;}``)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes`` (CUDA 12.8+)."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation),
                ("flags", ctypes.c_uint)]


class DirectError(RuntimeError):
    """A runtime call made through :class:`Direct` failed."""


def _mapped_cudart() -> str | None:
    """The path of the ``libcudart.so*`` mapped into this process (None: none is)."""
    try:
        for line in MAPS.read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "/libcudart.so" in fields[5]:
                return fields[5].strip()
    except OSError:
        return None
    return None


class Direct:
    """The calls, bound to one loaded runtime (see the module docstring)."""

    def __init__(self, path: str) -> None:
        held = ctypes.PyDLL(path)  # calls keep the interpreter lock
        free = ctypes.CDLL(path)  # calls release it (the blocking ones, and batch(release=True))
        version = ctypes.c_int(0)
        if held.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            raise DirectError("cudaRuntimeGetVersion failed")
        self.version = version.value
        if self.version < 12080:
            raise DirectError(f"runtime {self.version} has no cudaMemcpyBatchAsync (12.8+)")
        self.path = path
        self._batch = held.cudaMemcpyBatchAsync
        # CUDA 13 dropped the failIdx argument (12.8 / 12.9: ..., numAttrs, size_t* failIdx, stream)
        head: list[Any] = [_VOID_PP, _VOID_PP, _SIZE_P, ctypes.c_size_t, ctypes.POINTER(MemcpyAttributes), _SIZE_P,
                           ctypes.c_size_t]
        self._batch.argtypes = head + ([] if self.version >= 13000 else [_SIZE_P]) + [ctypes.c_void_p]
        self._batch.restype = ctypes.c_int
        self._batch_free = free.cudaMemcpyBatchAsync  # (the same call, giving up the lock: stores, split loads)
        self._batch_free.argtypes, self._batch_free.restype = self._batch.argtypes, ctypes.c_int
        self._record = held.cudaEventRecord
        self._record.argtypes, self._record.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        self._query = held.cudaEventQuery
        self._query.argtypes, self._query.restype = [ctypes.c_void_p], ctypes.c_int
        self._sync = free.cudaEventSynchronize
        self._sync.argtypes, self._sync.restype = [ctypes.c_void_p], ctypes.c_int
        self._create = held.cudaEventCreateWithFlags
        self._create.argtypes, self._create.restype = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint], ctypes.c_int
        self._destroy = held.cudaEventDestroy
        self._destroy.argtypes, self._destroy.restype = [ctypes.c_void_p], ctypes.c_int
        self._wait = held.cudaStreamWaitEvent
        self._wait.argtypes, self._wait.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint], ctypes.c_int
        self._elapsed = held.cudaEventElapsedTime
        self._elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        self._elapsed.restype = ctypes.c_int
        self._name = held.cudaGetErrorName
        self._name.argtypes, self._name.restype = [ctypes.c_int], ctypes.c_char_p
        self._attr = MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, MemLocation(0, 0), MemLocation(0, 0),
                                      PREFER_OVERLAP_WITH_COMPUTE)
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)

    def check(self, err: int, what: str) -> None:
        if err != 0:
            name = self._name(err)
            raise DirectError(f"{what}: {name.decode() if name else err}")

    def batch(self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64],
              stream: int, release: bool = False) -> None:
        """``cudaMemcpyBatchAsync`` of ``src[i] -> dst[i]`` (``lengths[i]`` bytes) on ``stream``, one
        call per :data:`BATCH_MAX` copies (``release``: the interpreter lock is given up during each
        call, so threads issue at once)."""
        d = np.ascontiguousarray(dst, dtype=np.uint64)
        s = np.ascontiguousarray(src, dtype=np.uint64)
        n = np.ascontiguousarray(lengths, dtype=np.uint64)
        call = self._batch_free if release else self._batch
        for i in range(0, len(d), BATCH_MAX):
            m = min(BATCH_MAX, len(d) - i)
            args: list[Any] = [d[i:].ctypes.data_as(_VOID_PP), s[i:].ctypes.data_as(_VOID_PP),
                               n[i:].ctypes.data_as(_SIZE_P), m, ctypes.byref(self._attr), self._attr_idx, 1]
            if self.version < 13000:  # (a call giving up the lock may run beside another: its own failIdx)
                args.append(ctypes.byref(ctypes.c_size_t(0) if release else self._fail))
            self.check(call(*args, stream), f"cudaMemcpyBatchAsync ({m} copies)")

    def event(self, timed: bool = False) -> "RawEvent":
        return RawEvent(self, timed)

    def wait(self, stream: int, event: "RawEvent") -> None:
        """``stream`` runs nothing enqueued after this before ``event`` (as recorded now) fired."""
        self.check(self._wait(stream, event.handle, 0), "cudaStreamWaitEvent")


class RawEvent:
    """A CUDA event of :class:`Direct`'s runtime, with the methods the lane uses of torch's."""

    def __init__(self, rt: Direct, timed: bool = False) -> None:
        self.rt = rt
        handle = ctypes.c_void_p(0)
        rt.check(rt._create(ctypes.byref(handle), 0 if timed else DISABLE_TIMING), "cudaEventCreateWithFlags")
        self.handle = handle.value

    def record(self, stream: int) -> None:
        self.rt.check(self.rt._record(self.handle, stream), "cudaEventRecord")

    def query(self) -> bool:
        err = self.rt._query(self.handle)
        if err == NOT_READY:
            return False
        self.rt.check(err, "cudaEventQuery")
        return True

    def synchronize(self) -> None:
        self.rt.check(self.rt._sync(self.handle), "cudaEventSynchronize")

    def elapsed_time(self, end: "RawEvent") -> float:
        ms = ctypes.c_float(0.0)
        self.rt.check(self.rt._elapsed(ctypes.byref(ms), self.handle, end.handle), "cudaEventElapsedTime")
        return float(ms.value)

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self.rt._destroy(self.handle)
            self.handle = None


def load() -> Direct | None:
    """The direct calls on the runtime mapped in this process, or None (logged) where unusable."""
    path = _mapped_cudart()
    if path is None:
        log.info("no libcudart mapped in the daemon: copies are issued through cuda-python")
        return None
    try:
        return Direct(path)
    except (OSError, AttributeError, DirectError) as exc:
        log.info("direct CUDA calls unusable (%s: %s): copies are issued through cuda-python", path, exc)
        return None


def checked(device: int) -> Direct | None:
    """The direct calls (:func:`load`) if a copy through them, host -> GPU -> host in
    scattered pieces on ``device``, moves exactly the bytes it names (else None, logged)."""
    import torch
    direct = load()
    if direct is None:
        return None
    try:
        with torch.cuda.device(device):
            new_stream: Any = torch.cuda.Stream  # (untyped constructor)
            stream = new_stream(device=device)
            n, unit = 64, 4096
            src = torch.randint(0, 256, (n * unit,), dtype=torch.uint8).pin_memory()
            back = torch.zeros(n * unit, dtype=torch.uint8).pin_memory()
            dev = torch.zeros(n * unit, dtype=torch.uint8, device=f"cuda:{device}")
            order = np.random.default_rng(7).permutation(n).astype(np.int64)
            lengths = np.full(n, unit, np.int64)
            dev_at = dev.data_ptr() + order * unit
            direct.batch(dev_at, src.data_ptr() + np.arange(n, dtype=np.int64) * unit, lengths, stream.cuda_stream)
            direct.batch(back.data_ptr() + np.arange(n, dtype=np.int64) * unit, dev_at, lengths, stream.cuda_stream)
            done = direct.event()
            done.record(stream.cuda_stream)
            done.synchronize()
            expect = src.view(n, unit)[torch.from_numpy(np.argsort(order))].reshape(-1)
            ok = torch.equal(dev.cpu(), expect) and torch.equal(back, src)
    except (DirectError, RuntimeError, ctypes.ArgumentError) as exc:
        log.warning("direct CUDA calls failed their check (%s); copies are issued through cuda-python", exc)
        return None
    if not ok:
        log.warning("a copy through the direct CUDA calls (%s) moved the wrong bytes; copies are issued through "
                    "cuda-python", direct.path)
        return None
    log.debug("copies issued through %s (runtime %d)", direct.path, direct.version)
    return direct
