"""The engine's KV cache as the worker sees it: buffers it mapped and where each
(layer, block) page lives in them.

Runs in the worker daemon. Page (layer, block) is ``page_bytes`` long at
``buffers[layer.buffer_index] + layer.offset_bytes + block * layer.block_stride_bytes``. Registration checks
that every page of every layer lies inside its buffer, so no later transfer can address
memory outside what the engine handed over.

Media: ``shm`` (a CPU engine's buffer in a file the worker can mmap, e.g. /dev/shm) lives
here; CUDA IPC import belongs to ``handlers/cuda.py`` (GPU data path).
"""
from __future__ import annotations

import mmap
import os
import uuid

import numpy as np

from kvbm_client.contract import pb
from kvbm_client.regions import LayerSpec


class RegionError(ValueError):
    """The registration request does not describe memory the worker can safely address."""


class EngineRegion:
    """A CPU engine's KV cache mapped from shared memory."""

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
        self.buffers: list[np.ndarray] = []
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

    def _validate_shape(self, request) -> None:
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

    def _map(self, index: int, buf) -> np.ndarray:
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
