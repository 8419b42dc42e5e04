"""How an engine describes its KV cache to a worker (the engine side of region import).

A CPU engine puts its KV buffer in a sealed memfd (:func:`sealed_memfd`, :class:`ShmKvBuffer`)
and hands the fd itself to the worker over the region socket (:mod:`.region_wire`); the
worker maps that very memory and never opens a path. Page (layer, block) lives at
``buffer + layer_offset + block * block_stride``.

NOTE: the seals (``F_SEAL_SHRINK | F_SEAL_GROW``) make the memfd's size final: nobody, the
engine included, can truncate it under the worker's mapping, so a copy can never fault
(SIGBUS) on a page that went away.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from .contract import pb

#: seals a region memfd carries (the worker requires at least F_SEAL_SHRINK)
REGION_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


@dataclass(frozen=True)
class LayerSpec:
    buffer_index: int
    offset_bytes: int
    block_stride_bytes: int


def sealed_memfd(name: str, size: int) -> int:
    """A new memfd of ``size`` bytes whose size can never change (close-on-exec; the caller
    owns the fd and maps it, e.g. ``torch.from_file(f"/proc/self/fd/{fd}", shared=True)``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REGION_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class RegionSpecLike(Protocol):
    """A region description a worker can be handed: :class:`RegionSpec` (memfds) or
    ``CudaRegionSpec`` (CUDA IPC handles, no fds)."""

    @property
    def engine_id(self) -> str: ...

    @property
    def layers(self) -> "tuple[LayerSpec, ...]":
        """Every page of a block, in the region's page order."""

    def to_request(self) -> "pb.RegisterRegionRequest": ...

    @property
    def fds(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class RegionSpec:
    """Everything a worker needs to address every (layer, block) page of a CPU engine.

    ``memfds[i]`` backs buffer ``i`` (sealed memfds, owned by the caller: they must stay open
    until the registration was sent); ``buffer_sizes[i]`` is its size.
    """

    memfds: tuple[int, ...]
    buffer_sizes: tuple[int, ...]
    layers: tuple[LayerSpec, ...]
    page_bytes: int
    num_blocks: int
    dtype: str = "uint8"
    engine_id: str = field(default_factory=lambda: f"engine-{uuid.uuid4().hex[:8]}")

    @property
    def fds(self) -> Sequence[int]:
        return self.memfds

    def to_request(self) -> "pb.RegisterRegionRequest":
        buffers = [pb.RegionBuffer(fd_index=i, size_bytes=s, device=-1) for i, s in enumerate(self.buffer_sizes)]
        return region_request(self, buffers)


def region_request(spec: Any, buffers: list["pb.RegionBuffer"]) -> "pb.RegisterRegionRequest":
    """The registration message of a region spec (shared by the memfd and CUDA specs). No pid:
    the worker takes the owner from the region socket (SO_PEERCRED)."""
    return pb.RegisterRegionRequest(
        engine_id=spec.engine_id, buffers=buffers,
        layers=[pb.LayerPlacement(buffer_index=l.buffer_index, offset_bytes=l.offset_bytes,
                                  block_stride_bytes=l.block_stride_bytes) for l in spec.layers],
        page_bytes=spec.page_bytes, num_blocks=spec.num_blocks, dtype=spec.dtype)


class ShmKvBuffer:
    """A KV cache buffer in a sealed memfd, laid out ``[num_blocks, num_layers, page_bytes]``
    (block-major, like a fully contiguous layout).

    Used by CPU engines and tests; ``close()`` unmaps it and closes the fd (the memory is
    freed when the worker dropped its mapping too). ``directory`` is ignored (the buffer used
    to be a /dev/shm file; kept so callers written before still run).
    """

    def __init__(self, num_blocks: int, num_layers: int, page_bytes: int, directory: str | None = None,
                 name: str | None = None) -> None:
        self.num_blocks, self.num_layers, self.page_bytes = num_blocks, num_layers, page_bytes
        self.nbytes = num_blocks * num_layers * page_bytes
        self.fd = sealed_memfd(name or f"kvbm-engine-{os.getpid()}", self.nbytes)
        try:
            self._mmap = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._mmap, dtype=np.uint8).reshape(num_blocks, num_layers, page_bytes)

    def spec(self, dtype: str = "uint8", engine_id: str | None = None) -> RegionSpec:
        block_stride = self.num_layers * self.page_bytes
        layers = tuple(LayerSpec(0, layer * self.page_bytes, block_stride) for layer in range(self.num_layers))
        kw = {"engine_id": engine_id} if engine_id else {}
        return RegionSpec((self.fd,), (self.nbytes,), layers, self.page_bytes, self.num_blocks, dtype, **kw)

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
