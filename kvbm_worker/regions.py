"""The engine's KV cache as the worker sees it: buffers it mapped and where each
(layer, block) page lives in them.

Runs in the worker daemon. Page (layer, block) is ``page_bytes`` long at
``buffers[layer.buffer_index] + layer.offset_bytes + block * layer.block_stride_bytes``. Registration checks
that every page of every layer lies inside its buffer, so no later transfer can address
memory outside what the engine handed over.

Media: ``shm`` (a CPU engine's buffer in a file the worker can mmap, e.g. /dev/shm) lives
here; CUDA IPC import belongs to ``cuda_region.py`` (GPU data path).

Every request first passes :func:`check_request` (sizes and names within the configured
limits), before any file is opened or any memory mapped.
"""
from __future__ import annotations

import mmap
import os
import uuid
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbm_client.config import KvbmConfig
from kvbm_client.contract import pb
from kvbm_client.regions import LayerSpec

from .id_arrays import EngineBlocks


class RegionError(ValueError):
    """The registration request does not describe memory the worker can safely address."""


@dataclass(frozen=True, slots=True)
class RegionLimits:
    """How much one registration may describe (``DYN_KVBM_MAX_REGION_*``, ``_MAX_NAME_BYTES``)."""

    max_pages: int = 8192  # layer placements (one per layer, or per K and V)
    max_buffers: int = 64
    max_name_bytes: int = 256

    @classmethod
    def of(cls, config: KvbmConfig) -> "RegionLimits":
        return cls(config.max_region_pages, config.max_region_buffers, config.max_name_bytes)


def check_request(request: "pb.RegisterRegionRequest", limits: RegionLimits) -> None:
    """Raise :class:`RegionError` if the request exceeds ``limits`` (pure; nothing is opened)."""
    if len(request.engine_id.encode()) > limits.max_name_bytes:
        raise RegionError(f"engine_id of {len(request.engine_id.encode())} bytes; at most {limits.max_name_bytes} "
                          "(DYN_KVBM_MAX_NAME_BYTES)")
    if len(request.layers) > limits.max_pages:
        raise RegionError(f"{len(request.layers)} layer placements; at most {limits.max_pages} "
                          "(DYN_KVBM_MAX_REGION_PAGES)")
    if len(request.buffers) > limits.max_buffers:
        raise RegionError(f"{len(request.buffers)} buffers; at most {limits.max_buffers} "
                          "(DYN_KVBM_MAX_REGION_BUFFERS)")


class EngineRegion:
    """A CPU engine's KV cache mapped from shared memory.

    Owns its mappings (``close()`` unmaps). Invariant: every page of every layer lies inside
    its buffer (checked at registration, before the region is usable).
    """

    def __init__(self, request: "pb.RegisterRegionRequest") -> None:
        self.region_id = f"region-{uuid.uuid4().hex[:12]}"
        self.engine_id = request.engine_id
        self.pid = request.pid
        self.page_bytes = int(request.page_bytes)
        self.num_blocks = int(request.num_blocks)
        self.dtype = request.dtype
        self.layers = [LayerSpec(lp.buffer_index, lp.offset_bytes, lp.block_stride_bytes) for lp in request.layers]
        self._validate_shape(request)
        self._maps: list[mmap.mmap] = []
        self.buffers: list[npt.NDArray[np.uint8]] = []
        self.layer_views: list[npt.NDArray[np.uint8]] = []
        try:
            for i, buf in enumerate(request.buffers):
                self.buffers.append(self._map(i, buf))
            self._validate_bounds()
            self.layer_views = [
                np.lib.stride_tricks.as_strided(self.buffers[ls.buffer_index][ls.offset_bytes:],
                                                shape=(self.num_blocks, self.page_bytes), strides=(ls.block_stride_bytes, 1))
                for ls in self.layers]
        except BaseException:
            self.close()
            raise

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.page_bytes

    def check_blocks(self, blocks: EngineBlocks) -> None:
        """Defence in depth before a copy: every engine block id lies in the region."""
        if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= self.num_blocks):
            raise ValueError(f"engine blocks {int(blocks.min())}..{int(blocks.max())} outside "
                             f"0..{self.num_blocks - 1}")

    def _validate_shape(self, request: "pb.RegisterRegionRequest") -> None:
        if not request.buffers:
            raise RegionError("no buffers")
        if not self.layers:
            raise RegionError("no layers")
        if self.page_bytes <= 0 or self.num_blocks <= 0:
            raise RegionError("page_bytes and num_blocks must be > 0")
        for i, ls in enumerate(self.layers):
            if ls.buffer_index >= len(request.buffers):
                raise RegionError(f"layer {i} names buffer {ls.buffer_index}; only {len(request.buffers)} given")
            if self.num_blocks > 1 and ls.block_stride_bytes < self.page_bytes:
                raise RegionError(f"layer {i}: block stride {ls.block_stride_bytes} < page_bytes {self.page_bytes} "
                                  "(pages would overlap)")

    def _map(self, index: int, buf: "pb.RegionBuffer") -> npt.NDArray[np.uint8]:
        kind = buf.WhichOneof("handle")
        if kind != "shm_path":
            raise RegionError(f"buffer {index}: {kind or 'no handle'} is not served by a CPU worker "
                              "(start the worker with CUDA for cuda_ipc_handle)")
        try:
            fd = os.open(buf.shm_path, os.O_RDWR)
        except OSError as exc:
            raise RegionError(f"buffer {index}: cannot open {buf.shm_path}: {exc.strerror}") from None
        try:
            actual = os.fstat(fd).st_size
            if buf.size_bytes == 0 or actual < buf.offset_bytes + buf.size_bytes:
                raise RegionError(f"buffer {index}: {buf.shm_path} has {actual} bytes; "
                                  f"registration claims {buf.size_bytes} at offset {buf.offset_bytes}")
            mm = mmap.mmap(fd, actual, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._maps.append(mm)
        whole = np.frombuffer(mm, dtype=np.uint8)
        return whole[buf.offset_bytes:buf.offset_bytes + buf.size_bytes]

    def _validate_bounds(self) -> None:
        for i, ls in enumerate(self.layers):
            end = ls.offset_bytes + (self.num_blocks - 1) * ls.block_stride_bytes + self.page_bytes
            size = self.buffers[ls.buffer_index].nbytes
            if end > size:
                raise RegionError(f"layer {i}: last page ends at byte {end}, buffer {ls.buffer_index} "
                                  f"has {size} bytes")

    def close(self) -> None:
        self.layer_views = []
        self.buffers = []
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still referenced; unmapped when collected
        self._maps = []
