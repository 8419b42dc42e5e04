"""One rank's paged KV pool in TensorRT-LLM's layout, as the driver's "model" reads and writes it.

TensorRT-LLM allocates the primary pool of a KV cache manager as one tensor for all layers,
``[num_blocks, num_layers, kv_factor=2, num_kv_heads * tokens_per_block * head_dim]``, and hands
exactly that tensor (``get_unique_primary_pool()``) to ``KvCacheConnectorWorker.register_kv_caches``.
Inside a (block, layer, K|V) page the attention kernels use ``[heads, tokens, head_dim]``; the
model here writes that order too, though to a connector a page is opaque bytes.

On the CPU the pool lives in a sealed memfd mapped shared (``torch.from_file`` of
``/proc/self/fd/N``), which the connector hands to a kvbm worker daemon over its region socket; with ``device="cuda:N"`` it is an ordinary CUDA tensor.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from kvbm_client.regions import sealed_memfd

from .kv_model import POISON, KvGeometry

#: Name of the pool memfds (``<prefix>r<rank>``, shown as ``/memfd:<name>`` in /proc/PID/maps).
MEMFD_PREFIX = "kvbm-trtllm-kv-"


class PagedKvCache:
    """The KV pool of one rank. Owns the tensor (and on the CPU its memfd).

    Invariant: ``tensor`` keeps its storage for the cache's whole life, so a worker that mapped
    it (or exported it through CUDA IPC) addresses the same pages until :meth:`close`.
    """

    def __init__(self, geometry: KvGeometry, num_blocks: int, rank: int, device: str = "cpu") -> None:
        self.geometry, self.num_blocks, self.rank = geometry, num_blocks, rank
        self.device = torch.device(device)
        shape = geometry.pool_shape(num_blocks)
        numel = num_blocks * geometry.num_layers * 2 * geometry.block_elems
        self.memfd: Optional[int] = None
        if self.device.type == "cpu":
            self.memfd = sealed_memfd(f"{MEMFD_PREFIX}r{rank}", numel * geometry.dtype.itemsize)
            flat = torch.from_file(f"/proc/self/fd/{self.memfd}", shared=True, size=numel, dtype=geometry.dtype)
            self.tensor = flat.view(shape)
        else:
            self.tensor = torch.empty(shape, dtype=geometry.dtype, device=self.device)
        g = geometry
        self._pages = self.tensor.view(torch.int16).view(
            num_blocks, g.num_layers, 2, g.heads_per_rank, g.tokens_per_block, g.head_dim)
        self.tensor.view(torch.int16).fill_(POISON)  # uninitialised memory

    def write(self, layer: int, block_table: Sequence[int], start: int, stop: int, values: torch.Tensor) -> None:
        """Write one layer's K and V (int16 ``(stop - start, 2, heads, head_dim)``) at positions
        ``start .. stop-1`` of the sequence whose blocks are ``block_table``."""
        b = self.geometry.tokens_per_block
        pos = torch.arange(start, stop)
        blocks = torch.tensor(list(block_table), dtype=torch.long)[pos // b]
        self._pages[blocks.to(self.device), layer, :, :, (pos % b).to(self.device), :] = values.to(self.device)

    def read(self, block_table: Sequence[int], start: int, stop: int, layer: Optional[int] = None) -> torch.Tensor:
        """The int16 KV of positions ``start .. stop-1``: ``(P, 2, heads, head_dim)`` of one layer,
        ``(P, num_layers, 2, heads, head_dim)`` of all."""
        b = self.geometry.tokens_per_block
        first, last = start // b, -(-stop // b)
        index = torch.tensor(list(block_table[first:last]), dtype=torch.long, device=self.device)
        if layer is None:
            pages = self._pages[index].permute(0, 4, 1, 2, 3, 5)  # (blocks, tokens, L, 2, heads, dim)
        else:
            pages = self._pages[index, layer].permute(0, 3, 1, 2, 4)  # (blocks, tokens, 2, heads, dim)
        flat = pages.reshape((-1,) + tuple(pages.shape[2:]))
        return flat[start - first * b:stop - first * b]

    def poison(self, block_ids: Sequence[int]) -> None:
        """Fill whole blocks with :data:`POISON` (what freed or fresh memory holds)."""
        if block_ids:
            index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
            self._pages[index] = POISON

    def checksum(self, block_table: Sequence[int], stop: int) -> int:
        """A position-sensitive sum of every KV element of positions ``0 .. stop-1`` (all layers)."""
        data = self.read(block_table, 0, stop).reshape(-1).to(torch.int64)
        weights = torch.arange(data.numel(), device=self.device, dtype=torch.int64) % 65521 + 1
        return int((data * weights).sum().item())

    def close(self) -> None:
        """Drop the tensor and close the memfd (a daemon's mapping keeps its pages). Idempotent."""
        self._pages = None  # type: ignore[assignment]
        self.tensor = None  # type: ignore[assignment]
        if self.memfd is not None:
            os.close(self.memfd)
            self.memfd = None
