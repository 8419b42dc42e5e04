"""The engine's GPU KV cache as the worker sees it: allocations opened through CUDA IPC.

Runs in the worker daemon (``kvbm-worker --gpu N``). The engine exports each allocation that
holds KV pages (``kvbm_client.cuda_export``); the worker opens each distinct handle once with
``cudaIpcOpenMemHandle`` and addresses page (layer, block) at
``buffer + layer.offset_bytes + block * layer.block_stride_bytes`` exactly like a CPU region, so every bound
check of :class:`~kvbm_worker.regions.EngineRegion` holds unchanged.

The handles arrive over the region socket only (never gRPC): the connection's peer
(SO_PEERCRED, our own uid) is the region's owner, and the region ends with that connection.
NOTE: CUDA cannot tell who exported a legacy IPC handle; what binds a handle to its owner is
that only that peer's connection carries it and keeps it registered.

Everything CUDA is imported lazily: this module imports on a machine without CUDA.
"""
from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import numpy.typing as npt

from kvbm_client.contract import SIGNAL_PAGE_BYTES, pb

from .id_arrays import EngineBlocks
from .regions import EngineRegion, Peer, RegionError

if TYPE_CHECKING:
    from .signals import SignalPage

log = logging.getLogger("kvbm.worker")

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class CudaError(RuntimeError):
    """A CUDA runtime call failed."""


def cudart() -> Any:
    """cuda-python's runtime bindings (``cuda.bindings.runtime``, or ``cuda.cudart`` before 12.6)."""
    try:
        return importlib.import_module("cuda.bindings.runtime")
    except ImportError:
        return importlib.import_module("cuda.cudart")


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(err, *values)`` tuple; raise :class:`CudaError` on failure."""
    rt = cudart()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        raise CudaError(f"{what}: {getattr(err, 'name', err)}")
    return values[0] if len(values) == 1 else values


def device_tensor(ptr: int, nbytes: int, device: int) -> Any:
    """A uint8 torch tensor over ``nbytes`` of device memory at ``ptr`` (not owned)."""
    import torch

    class _Mem:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                    "strides": None}
    return torch.as_tensor(_Mem(), device=f"cuda:{device}")


class CudaEngineRegion(EngineRegion):
    """A GPU engine's KV cache opened through CUDA IPC (or, for tests and benchmarks, local tensors).

    Owns the IPC mappings (closed by :meth:`close`). ``buffer_ptrs[i]`` is the device address of
    buffer ``i``; ``layer_base``/``layer_stride`` give every page's address with one numpy
    broadcast. Invariant: every page of every layer lies inside its buffer (checked at open).
    """

    def __init__(self, request: "pb.RegisterRegionRequest", owner: Peer, device: int) -> None:
        import torch
        self._init_common(request, owner)
        self.device = device
        self._validate_shape(request)
        self._maps = []
        self._opened: dict[bytes, int] = {}  # handle -> base pointer, each handle opened once
        self._allocation_end: dict[int, int] = {}  # base pointer -> end of its allocation
        self.buffers: list[Any] = []  # torch tensors (uint8) on the device
        self.buffer_ptrs: list[int] = []
        torch.cuda.set_device(device)
        try:
            for i, buf in enumerate(request.buffers):
                ptr = self._open(i, buf)
                self.buffer_ptrs.append(ptr)
                self.buffers.append(device_tensor(ptr, int(buf.size_bytes), device))
            self._validate_bounds()
        except BaseException:
            self.close()
            raise
        self._index()

    @classmethod
    def from_local(cls, tensors: Sequence[Any], layers: list[tuple[int, int, int]], page_bytes: int, num_blocks: int,
                   dtype: str = "uint8") -> "CudaEngineRegion":
        """A region over this process's own tensors (tests, benchmarks: IPC cannot open a handle
        in the process that made it). ``layers`` are (buffer_index, offset, stride)."""
        import torch
        self = cls.__new__(cls)
        request = pb.RegisterRegionRequest(
            engine_id="local", page_bytes=page_bytes, num_blocks=num_blocks, dtype=dtype,
            layers=[pb.LayerPlacement(buffer_index=b, offset_bytes=o, block_stride_bytes=s) for b, o, s in layers])
        self._init_common(request, Peer(os.getpid(), os.getuid(), os.getgid()))
        self.device = tensors[0].device.index
        self._maps, self._opened, self._allocation_end = [], {}, {}
        self.buffers = [t.reshape(-1).view(torch.uint8) for t in tensors]
        self.buffer_ptrs = [t.data_ptr() for t in tensors]
        self._validate_bounds()
        self._index()
        return self

    def _index(self) -> None:
        self.layer_base = np.array([self.buffer_ptrs[ls.buffer_index] + ls.offset_bytes for ls in self.layers], np.int64)
        self.layer_stride = np.array([ls.block_stride_bytes for ls in self.layers], np.int64)
        self.layer_views = []  # no host views: the CPU handler must never touch this region

    def page_addresses(self, blocks: EngineBlocks) -> npt.NDArray[np.int64]:
        """Device address of page (layer, block) for every block: shape (len(blocks), num_layers).

        Raises ValueError for a block outside the region (a DMA must never leave it)."""
        self.check_blocks(blocks)
        return self.layer_base[None, :] + blocks.astype(np.int64)[:, None] * self.layer_stride[None, :]

    def _open(self, index: int, buf: "pb.RegionBuffer") -> int:
        kind = buf.WhichOneof("handle")
        if kind != "cuda_ipc_handle":
            raise RegionError(f"buffer {index}: {kind or 'no handle'} in a CUDA region (mixing host and "
                              "device buffers is not supported)")
        handle = bytes(buf.cuda_ipc_handle)
        if len(handle) != IPC_HANDLE_BYTES:
            raise RegionError(f"buffer {index}: CUDA IPC handle of {len(handle)} bytes, expected "
                              f"{IPC_HANDLE_BYTES} (expandable segments are not supported)")
        if buf.device != self.device:
            raise RegionError(f"buffer {index} lives on device {buf.device}; this worker serves device "
                              f"{self.device}")
        if buf.size_bytes == 0:
            raise RegionError(f"buffer {index}: size_bytes is 0")
        base = self._opened.get(handle)
        if base is None:
            rt = cudart()
            mem = rt.cudaIpcMemHandle_t()
            import ctypes
            ctypes.memmove(mem.getPtr(), handle, IPC_HANDLE_BYTES)
            try:
                check(rt.cudaSetDevice(self.device), "cudaSetDevice")
                base = int(check(rt.cudaIpcOpenMemHandle(mem, rt.cudaIpcMemLazyEnablePeerAccess),
                                 "cudaIpcOpenMemHandle"))
            except CudaError as exc:
                raise RegionError(f"buffer {index}: {exc} (is the engine alive, on this device, and "
                                  "is the handle from cudaIpcGetMemHandle?)") from None
            self._opened[handle] = base
            # NOTE: the allocation's size is not in the handle; cuMemGetAddressRange bounds it.
            self._allocation_end[base] = base + _allocation_size(base)
        end = base + int(buf.offset_bytes) + int(buf.size_bytes)
        if end > self._allocation_end[base]:
            raise RegionError(f"buffer {index}: offset {buf.offset_bytes} + size {buf.size_bytes} runs past "
                              f"the {self._allocation_end[base] - base}-byte allocation")
        return base + int(buf.offset_bytes)

    def attach_signals(self, page: "SignalPage") -> None:
        """Register the page's mapping with CUDA, so the copy stream can write its words
        (a 4-byte DMA) after a group's copies."""
        rt = cudart()
        check(rt.cudaSetDevice(self.device), "cudaSetDevice")
        flags = rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable
        try:
            check(rt.cudaHostRegister(page.address, SIGNAL_PAGE_BYTES, flags), "cudaHostRegister")
            page.unregister = lambda: _host_unregister(page.address)
            page.device_ptr = int(check(rt.cudaHostGetDevicePointer(page.address, 0), "cudaHostGetDevicePointer"))
        except CudaError as exc:
            page.close()
            raise RegionError(f"signal page: {exc}") from None
        super().attach_signals(page)

    def close(self) -> None:
        self._close_signals()
        self.buffers, self.buffer_ptrs = [], []
        if self._opened:
            rt = cudart()
            rt.cudaSetDevice(self.device)
            for base in self._opened.values():
                err = rt.cudaIpcCloseMemHandle(base)[0]
                if err != rt.cudaError_t.cudaSuccess:
                    log.warning("cudaIpcCloseMemHandle: %s", getattr(err, "name", err))
            self._opened = {}


def _host_unregister(address: int) -> None:
    err = cudart().cudaHostUnregister(address)[0]
    if err != cudart().cudaError_t.cudaSuccess:
        log.warning("cudaHostUnregister: %s", getattr(err, "name", err))


def _allocation_size(ptr: int) -> int:
    from cuda.bindings import driver
    err, base, size = driver.cuMemGetAddressRange(ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RegionError(f"cuMemGetAddressRange: {getattr(err, 'name', err)}")
    return int(size) - (ptr - int(base))
