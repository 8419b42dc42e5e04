"""How an engine describes its KV cache to a worker (the engine side of region import).

A CPU engine puts its KV buffer in shared memory (:class:`ShmKvBuffer`) and registers it;
the worker maps the same file. Page (layer, block) lives at
``buffer + layer_offset + block * block_stride``.
"""
from __future__ import annotations

import mmap
import os
import uuid
from dataclasses import dataclass, field

import numpy as np

from .contract import pb


@dataclass(frozen=True)
class LayerSpec:
    buffer_index: int
    offset_bytes: int
    block_stride_bytes: int


@dataclass(frozen=True)
class RegionSpec:
    """Everything a worker needs to address every (layer, block) page of an engine."""

    shm_paths: tuple[str, ...]
    buffer_sizes: tuple[int, ...]
    layers: tuple[LayerSpec, ...]
    page_bytes: int
    num_blocks: int
    dtype: str = "uint8"
    engine_id: str = field(default_factory=lambda: f"engine-{uuid.uuid4().hex[:8]}")

    def to_request(self, pid: int | None = None) -> "pb.RegisterRegionRequest":
        buffers = [pb.RegionBuffer(shm_path=p, size_bytes=s, device=-1)
                   for p, s in zip(self.shm_paths, self.buffer_sizes)]
        return region_request(self, buffers, pid)


def region_request(spec, buffers: list, pid: int | None = None) -> "pb.RegisterRegionRequest":
    """The registration message of a region spec (shared by the shm and CUDA specs)."""
    return pb.RegisterRegionRequest(
        engine_id=spec.engine_id, pid=pid if pid is not None else os.getpid(), buffers=buffers,
        layers=[pb.LayerPlacement(buffer_index=l.buffer_index, offset_bytes=l.offset_bytes,
                                  block_stride_bytes=l.block_stride_bytes) for l in spec.layers],
        page_bytes=spec.page_bytes, num_blocks=spec.num_blocks, dtype=spec.dtype)


class ShmKvBuffer:
    """A KV cache buffer in a shared-memory file (``/dev/shm`` by default), laid out
    ``[num_blocks, num_layers, page_bytes]`` (block-major, like a fully contiguous layout).

    Used by CPU engines and tests; ``close()`` unmaps and removes the file.
    """

    def __init__(self, num_blocks: int, num_layers: int, page_bytes: int, directory: str = "/dev/shm",
                 name: str | None = None) -> None:
        self.num_blocks, self.num_layers, self.page_bytes = num_blocks, num_layers, page_bytes
        self.path = os.path.join(directory, name or f"kvbm-engine-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.nbytes = num_blocks * num_layers * page_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self._mmap = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8).reshape(num_blocks, num_layers, page_bytes)

    def spec(self, dtype: str = "uint8", engine_id: str | None = None) -> RegionSpec:
        block_stride = self.num_layers * self.page_bytes
        layers = tuple(LayerSpec(0, layer * self.page_bytes, block_stride) for layer in range(self.num_layers))
        kw = {"engine_id": engine_id} if engine_id else {}
        return RegionSpec((self.path,), (self.nbytes,), layers, self.page_bytes, self.num_blocks, dtype, **kw)

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
