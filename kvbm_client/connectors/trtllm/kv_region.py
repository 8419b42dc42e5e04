"""Which memory holds TensorRT-LLM's KV pool, described as a kvbm region.

Runs in each rank's worker role, once, in ``register_kv_caches``. TensorRT-LLM hands over one
tensor for all layers, ``[num_blocks, num_layers, 2 (K, V), tokens_per_block * kv_heads *
head_dim]`` (``KVCacheManager.get_unique_primary_pool()``); block ``b`` is ``tensor[b]``, one
contiguous run. kvbm describes it as one page per block (``page_bytes`` = the whole block, all
layers, K then V), the same on both media, so a G2 slot holds the block's bytes in pool order:

* on a GPU: the CUDA IPC export the vLLM connector uses (:func:`~kvbm_client.cuda_export.export_kv_cache`);
* on the CPU (tests and CI): the sealed memfd the tensor lives in, found in
  ``/proc/self/maps`` (a shared mapping) and matched by inode to an open fd of this process
  (allocate the pool with :func:`kvbm_client.regions.sealed_memfd` and map
  ``/proc/self/fd/N`` shared). The fd must carry at least ``F_SEAL_SHRINK``: a pool that could
  shrink under the worker daemon's mapping is refused here, before the daemon refuses it.

How the description is handed over (the region socket, fds attached) is the worker core's
business (:class:`~kvbm_client.connectors.core.region_link.RegionLink`), not this module's.
"""
from __future__ import annotations

import fcntl
import os
import stat
from dataclasses import dataclass
from typing import Any

from ...cuda_export import CudaRegionSpec, export_kv_cache, page_placements
from ...regions import LayerSpec, RegionSpec

MAPS = "/proc/self/maps"
#: Dims of TensorRT-LLM's primary pool: blocks, layers, K/V, page.
POOL_DIMS = 4


@dataclass(frozen=True)
class SharedMemfd:
    """A sealed memfd of this process mapped shared, and where a tensor sits in it."""

    fd: int
    size_bytes: int
    #: byte offset of the tensor's first element in the memfd
    offset_bytes: int


def find_mapping(maps_text: str, address: int, length: int) -> tuple[int, int] | None:
    """Pure: in ``/proc/<pid>/maps`` text, the shared file mapping that holds
    ``[address, address + length)``, as ``(inode, file offset of address)``; None when the
    range is not inside one shared mapping of a file."""
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue  # anonymous memory
        span, perms, offset, _dev, inode, _path = fields
        start, end = (int(x, 16) for x in span.split("-"))
        if not start <= address < end:
            continue
        if address + length > end or perms[3:4] != "s" or int(inode) == 0:
            return None
        return int(inode), int(offset, 16) + address - start
    return None


def sealed_fd_of(inode: int, fd_dir: str = "/proc/self/fd") -> int | None:
    """An open fd of this process on the memfd ``inode`` that can no longer shrink, or None."""
    for name in os.listdir(fd_dir):
        fd = int(name)
        try:
            st = os.fstat(fd)
            if st.st_ino != inode or not stat.S_ISREG(st.st_mode):
                continue
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                return fd
        except OSError:  # closed meanwhile, or not a memfd (no seals)
            continue
    return None


def memfd_of(tensor: Any, maps_path: str = MAPS) -> SharedMemfd | None:
    """The sealed memfd a CPU tensor's memory lives in, or None (private, anonymous or
    unsealed memory)."""
    span = (sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1) * tensor.element_size()
    with open(maps_path) as f:
        found = find_mapping(f.read(), tensor.data_ptr(), span)
    if found is None:
        return None
    inode, offset = found
    fd = sealed_fd_of(inode)
    if fd is None:
        return None
    return SharedMemfd(fd, os.fstat(fd).st_size, offset)


def describe_kv_cache(kv_cache_tensor: Any, engine_id: str) -> RegionSpec | CudaRegionSpec:
    """The region of TensorRT-LLM's KV pool: one page per block (see the module doc).

    Raises:
        ValueError: not a 4-d pool with contiguous blocks, or CPU memory the worker daemon
            cannot map.
    """
    kv = kv_cache_tensor
    if kv.dim() != POOL_DIMS:
        raise ValueError(f"expected the [blocks, layers, 2, page] pool, got shape {tuple(kv.shape)}")
    if kv.is_cuda:
        return export_kv_cache(kv, block_dim=0, page_dims=POOL_DIMS - 1, engine_id=engine_id)
    num_blocks, page_bytes, pages = page_placements(tuple(kv.shape), tuple(kv.stride()), kv.element_size(), 0,
                                                    block_dim=0, page_dims=POOL_DIMS - 1)
    shared = memfd_of(kv)
    if shared is None:
        raise ValueError("the CPU KV pool is not in a sealed memfd of this process (allocate it with "
                         "kvbm_client.regions.sealed_memfd and map /proc/self/fd/N shared)")
    layers = tuple(LayerSpec(0, shared.offset_bytes + offset, stride) for offset, stride in pages)
    dtype = str(kv.dtype).removeprefix("torch.")
    return RegionSpec((shared.fd,), (shared.size_bytes,), layers, page_bytes, num_blocks, dtype,
                      engine_id=engine_id)
