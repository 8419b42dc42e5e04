"""The importing side of ``kvbm doctor``'s CUDA IPC check, run as its own process.

``python -m kvbm_client.doctor.ipc_child DEVICE HANDLE_HEX OFFSET NBYTES`` opens the
``cudaIpcMemHandle_t`` with cuda-python exactly as a GPU worker does
(``cudaIpcOpenMemHandle(..., cudaIpcMemLazyEnablePeerAccess)``), copies ``NBYTES`` from
``OFFSET`` into host memory and prints their SHA-256; exit 1 with the CUDA error on stderr.
"""
from __future__ import annotations

import ctypes
import hashlib
import sys

from .cudart import CudaCallError, check, runtime

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def read_ipc(device: int, handle: bytes, offset: int, nbytes: int) -> bytes:
    """Open ``handle`` on ``device``, copy ``nbytes`` at ``offset`` to the host, close it."""
    rt = runtime()
    mem = rt.cudaIpcMemHandle_t()
    ctypes.memmove(mem.getPtr(), handle, IPC_HANDLE_BYTES)
    check(rt.cudaSetDevice(device), "cudaSetDevice")
    base = int(check(rt.cudaIpcOpenMemHandle(mem, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))
    try:
        host = ctypes.create_string_buffer(nbytes)
        check(rt.cudaMemcpy(ctypes.addressof(host), base + offset, nbytes,
                            rt.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy")
        return host.raw
    finally:
        check(rt.cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle")


def main(argv: list[str]) -> int:
    device, handle, offset, nbytes = int(argv[0]), bytes.fromhex(argv[1]), int(argv[2]), int(argv[3])
    try:
        data = read_ipc(device, handle, offset, nbytes)
    except (ImportError, CudaCallError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(hashlib.sha256(data).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
