"""What the GPU copy benchmarks share (``issue_cost.py``, ``ipc_issue_cost.py``,
``staging_scatter.py``, ``daemon_layer_loads.py``, ``word_write_probe.py``,
``wait_copy_interference.py``): a pinned host pool like G2 with the worker's copier, a device
buffer exported to / opened from another process through CUDA IPC, that process's matmul spells,
a CUDA-registered host page (a signal page's stand-in), CPU hogs, and the result file
(provenance, arguments, device, rows)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing
from pathlib import Path
from typing import Any, Iterator

from provenance import provenance

from kvbm_worker.cuda_region import check, cudart
from kvbm_worker.handlers.cuda_copier import CudaCopier
from kvbm_worker.handlers.pinned import PIN_CHUNK, PinnedHost
from kvbm_worker.pools import HostPool, SlotGeometry

IPC_HANDLE_BYTES = 64


@contextlib.contextmanager
def pinned_copier(slot_bytes: int, slots: int) -> Iterator[tuple[HostPool, CudaCopier]]:
    """A host pool of ``slots`` slots, pinned on device 0 in 1 GiB ranges as the worker pins G2,
    and a :class:`CudaCopier` over it (``--cuda-copy auto``); all closed on exit."""
    host = HostPool(SlotGeometry.of(slot_bytes, slots))
    host.commit()
    pinned = PinnedHost(0)
    try:
        pinned.pin(host.address, host.buffer.nbytes, PIN_CHUNK)
        copier = CudaCopier(0, pinned)
        try:
            yield host, copier
        finally:
            copier.close()
    finally:
        pinned.close()
        host.close()


def export_ipc(ptr: int) -> bytes:
    """The CUDA IPC handle of the device allocation at ``ptr``."""
    handle = check(cudart().cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def open_ipc(handle: bytes) -> int:
    """The device address of another process's allocation, opened from its IPC ``handle``."""
    rt = cudart()
    mem = rt.cudaIpcMemHandle_t()
    ctypes.memmove(mem.getPtr(), handle, IPC_HANDLE_BYTES)
    return int(check(rt.cudaIpcOpenMemHandle(mem, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))


def ipc_engine(conn: Any, nbytes: int, dim: int) -> None:
    """The other process (an engine): allocates ``nbytes`` of device memory and sends its CUDA IPC
    handle; then, per ``seconds`` received, answers "on", runs bf16 ``dim`` x ``dim`` matmuls for
    that long and sends their rate (TFLOP/s); "stop" ends it. Run with a spawn context."""
    import time

    import torch
    torch.cuda.set_device(0)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    conn.send(export_ipc(buf.data_ptr()))
    a = torch.randn(dim, dim, device="cuda:0", dtype=torch.bfloat16)
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        seconds = float(cmd)
        conn.send("on")
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(4):
                torch.mm(a, a)
            torch.cuda.synchronize()
            n += 4
        conn.send(2 * dim ** 3 * n / (time.perf_counter() - t0) / 1e12)


@contextlib.contextmanager
def registered_page() -> Iterator[tuple[Any, int]]:
    """A 4 KiB host page registered with CUDA as the engine's signal page is (mapped, portable):
    its uint32 words (numpy) and its device address; unregistered on exit."""
    import mmap

    import numpy as np
    rt = cudart()
    page = mmap.mmap(-1, 4096)
    words = np.frombuffer(page, dtype="<u4")
    addr = words.ctypes.data
    check(rt.cudaHostRegister(addr, 4096, rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable), "register")
    try:
        yield words, int(check(rt.cudaHostGetDevicePointer(addr, 0), "device pointer"))
    finally:
        rt.cudaHostUnregister(addr)


def spin(stop: Any) -> None:
    """A CPU hog, until ``stop`` is set."""
    x = 0
    while not stop.is_set():
        for _ in range(100000):
            x += 1


class Hogs:
    """``n`` processes spinning on the CPU until :meth:`close` (the engine's busy processes)."""

    def __init__(self, n: int) -> None:
        self.stop = multiprocessing.Event()
        self.procs = [multiprocessing.Process(target=spin, args=(self.stop,), daemon=True) for _ in range(n)]
        for p in self.procs:
            p.start()

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join()


def write_result(path: Path | None, args: Any, rows: list[dict[str, Any]]) -> None:
    """The result file (nothing without ``path``): provenance, arguments, device, rows."""
    if path is None:
        return
    import torch
    path.write_text(json.dumps({"provenance": provenance(), "args": vars(args) | {"json": str(path)},
                                "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
