"""Page-granular views of a CUDA region's buffers: which page of which buffer holds a block's
layer, for the copies that run as GPU kernels (the ``gather`` mechanism of
:mod:`.cuda_copier`, a staged load's scatter in :mod:`.cuda_stage`).

Runs on the worker's lane threads; imports torch lazily (this module imports without CUDA).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..cuda_region import CudaEngineRegion


class GatherViews:
    """Page-granular views of a region's buffers, for the gather mechanism (``ok`` is False
    when a layer's offset or stride is not a multiple of the page size)."""

    def __init__(self, region: CudaEngineRegion) -> None:
        import torch
        p = region.page_bytes
        self.wide = p % 8 == 0 and all(ptr % 8 == 0 for ptr in region.buffer_ptrs)
        self.groups: list[tuple[npt.NDArray[np.int64], Any]] = []  # (layer indices, pages view)
        offsets = np.array([ls.offset_bytes for ls in region.layers], np.int64)
        by_buffer: dict[int, list[int]] = {}
        for i, ls in enumerate(region.layers):
            by_buffer.setdefault(ls.buffer_index, []).append(i)
        self.ok = bool(np.all(offsets % p == 0) and np.all(region.layer_stride % p == 0))
        self.page_offset = offsets // p
        self.page_stride = region.layer_stride // p
        self.single = False
        if not self.ok:
            return
        for b, layer_ids in by_buffer.items():
            buf = region.buffers[b]
            pages = buf[:(buf.numel() // p) * p].view(-1, p)
            self.groups.append((np.array(layer_ids, np.int64), pages.view(torch.int64) if self.wide else pages))
        self.single = len(self.groups) == 1 and np.array_equal(self.groups[0][0], np.arange(region.num_layers))
