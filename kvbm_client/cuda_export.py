"""Engine side of GPU region import: export the engine's KV cache through CUDA IPC.

Runs in the engine process (connector worker role, one per GPU rank). Each distinct CUDA
allocation holding KV pages becomes one ``RegionBuffer`` (its ``cudaIpcMemHandle_t``, the
offset of the tensor storage in the allocation, the storage size); each (layer, K|V)
page of a block becomes one ``LayerPlacement``. Both vLLM layouts are described:

* one buffer, all layers as views of it (cross-layer, ``[num_blocks, num_layers, 2, ...]``):
  ``export_kv_cache(kv, block_dim=0)``, every block one contiguous run;
* one tensor per layer (``[2, num_blocks, ...]``, FlashAttention): ``export_kv_cache(layers,
  block_dim=1)``; ``[num_blocks, 2, ...]`` (FlashInfer): ``block_dim=0``.

Pages are enumerated in C order of the non-block dims in front of the page dims, so a G2 slot
holds ``layer0.K, layer0.V, layer1.K, ...`` for all of these layouts and a block stored from
one layout can be loaded into another. The engine keeps the tensors alive while registered
and synchronizes its stream before asking for an offload.

The description is registered over the worker's region socket like a CPU region
(:mod:`.region_wire`): the handles go in the request, and the worker accepts them only from
that connection's peer, which becomes the region's owner (the region ends with the connection).
"""
from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from typing import Sequence

from .contract import pb
from .regions import LayerSpec, region_request


@dataclass(frozen=True)
class CudaBuffer:
    ipc_handle: bytes
    device: int
    offset_bytes: int  # of the tensor storage inside the IPC allocation
    size_bytes: int


@dataclass(frozen=True)
class CudaRegionSpec:
    """A GPU engine's KV cache as a worker addresses it (the CUDA twin of ``RegionSpec``)."""

    buffers: tuple[CudaBuffer, ...]
    layers: tuple[LayerSpec, ...]
    page_bytes: int
    num_blocks: int
    dtype: str = "uint8"
    engine_id: str = field(default_factory=lambda: f"engine-{uuid.uuid4().hex[:8]}")

    @property
    def fds(self) -> Sequence[int]:
        """None: the IPC handles travel in the request itself (over the region socket, whose
        peer becomes the region's owner)."""
        return ()

    def to_request(self) -> "pb.RegisterRegionRequest":
        buffers = [pb.RegionBuffer(cuda_ipc_handle=b.ipc_handle, size_bytes=b.size_bytes, device=b.device,
                                   offset_bytes=b.offset_bytes) for b in self.buffers]
        return region_request(self, buffers)


def page_placements(shape: Sequence[int], strides: Sequence[int], itemsize: int, storage_offset: int,
                    block_dim: int, page_dims: int) -> tuple[int, int, list[tuple[int, int]]]:
    """Pure layout arithmetic (elements in, bytes out): returns ``(num_blocks, page_bytes,
    [(offset, block_stride), ...])`` for every page of one tensor, in C order of its
    non-block, non-page dims.

    Raises ValueError when a page is not contiguous.
    """
    nd = len(shape)
    if not 0 <= block_dim < nd - page_dims:
        raise ValueError(f"block_dim {block_dim} must come before the {page_dims} page dims of a {nd}-d tensor")
    expected = 1
    for d in range(nd - 1, nd - page_dims - 1, -1):
        if shape[d] > 1 and strides[d] != expected:
            raise ValueError(f"page dims {tuple(shape[nd - page_dims:])} are not contiguous (strides {strides})")
        expected *= shape[d]
    page_bytes = expected * itemsize
    outer = [d for d in range(nd - page_dims) if d != block_dim]
    pages = []
    for index in itertools.product(*(range(shape[d]) for d in outer)):
        offset = storage_offset + sum(i * strides[d] for i, d in zip(index, outer))
        pages.append((offset * itemsize, strides[block_dim] * itemsize))
    return shape[block_dim], page_bytes, pages


def _ipc_mem_handle(shared: bytes) -> bytes:
    """The ``cudaIpcMemHandle_t`` inside torch's shareable handle.

    NOTE: torch >= 2.4 prefixes the 64 handle bytes with a version byte and a type byte
    (``c``: cudaMalloc segment, ``e``: expandable segment, which has no cudaIpcMemHandle_t).
    """
    if len(shared) == 64:
        return shared
    if len(shared) == 66 and shared[1:2] == b"c":
        return shared[2:]
    raise ValueError(f"unsupported torch CUDA shareable handle ({len(shared)} bytes, type {shared[1:2]!r}): "
                     "expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) are not supported")


def export_kv_cache(kv_caches, *, block_dim: int, page_dims: int = 3,
                    engine_id: str | None = None) -> CudaRegionSpec:
    """Describe ``kv_caches`` (one tensor, or one per layer) for a GPU worker.

    Args:
        kv_caches: a CUDA tensor or a sequence of them, all of one dtype and device.
        block_dim: the dim that indexes blocks (0 for ``[num_blocks, ...]``, 1 for ``[2, num_blocks, ...]``).
        page_dims: trailing dims that form one contiguous page (block_size, heads, head_dim).
    Raises:
        ValueError: inconsistent tensors, a non-contiguous page, or an unsupported IPC handle.
    """
    tensors = [kv_caches] if hasattr(kv_caches, "untyped_storage") else list(kv_caches)
    if not tensors:
        raise ValueError("no KV cache tensors")
    buffers: list[CudaBuffer] = []
    by_storage: dict[int, int] = {}
    layers: list[LayerSpec] = []
    num_blocks = page_bytes = None
    for t in tensors:
        if not t.is_cuda or t.dtype != tensors[0].dtype or t.device != tensors[0].device:
            raise ValueError("every KV tensor must be a CUDA tensor of one dtype on one device")
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in by_storage:
            device, handle, size, offset, *_ = storage._share_cuda_()
            handle = _ipc_mem_handle(bytes(handle))
            by_storage[key] = len(buffers)
            buffers.append(CudaBuffer(bytes(handle), int(device), int(offset), int(size)))
        n, page, pages = page_placements(t.shape, t.stride(), t.element_size(), t.storage_offset(),
                                         block_dim, page_dims)
        if num_blocks not in (None, n) or page_bytes not in (None, page):
            raise ValueError(f"tensors disagree: {n} blocks x {page} B pages vs {num_blocks} x {page_bytes}")
        num_blocks, page_bytes = n, page
        layers.extend(LayerSpec(by_storage[key], off, stride) for off, stride in pages)
    dtype = str(tensors[0].dtype).removeprefix("torch.")
    kw = {"engine_id": engine_id} if engine_id else {}
    assert page_bytes is not None and num_blocks is not None  # set by the first of the (non-empty) tensors
    return CudaRegionSpec(tuple(buffers), tuple(layers), page_bytes, num_blocks, dtype, **kw)
