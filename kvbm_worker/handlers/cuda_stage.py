"""A GPU worker's staging area (``kvbm-worker --gpu N --stage-mib M``) and its two copies: a
staged load's leading layer groups from pinned G2 slots into the area (DMA, before the engine's
blocks are known), then from the area into a CUDA IPC region's pages (one ``index_copy_`` per
staged group and buffer, once they are).

Runs on the load lane's thread; both copies are issued on the copier's load stream, so the
scatter follows the staging copies, and whatever the lane issues next (another stage into the
same area) follows the scatter. The index upload goes through a stream of its own: an upload
on the load stream would wait for every copy queued there. The layout is :mod:`..stages`'s.

Measured (``benchmarks/staging_scatter.py``, one H100): a 20K load's 2.97 GB scatter in 6 groups
takes 2.2 ms of GPU time alone; one staged group (495 MB) covers a delay of 8 ms before the
blocks are known: the load's last group landed 55.6 ms after the stage began against 64.0 ms for
the same load copied straight once the blocks were known.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..cuda_region import CudaEngineRegion
from ..id_arrays import EngineBlocks
from ..stages import StageLayout
from .cuda_copier import CudaCopier, Direction

Addrs = npt.NDArray[np.int64]


class CudaStage:
    """The area (``nbytes`` on the copier's device) and its copies. Owns the area and the upload stream."""

    def __init__(self, copier: CudaCopier, nbytes: int) -> None:
        import torch
        self.copier = copier
        self.device = copier.device
        self.area = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
        stream: Any = torch.cuda.Stream  # (untyped constructor)
        self._uploads = stream(device=self.device)

    def warm(self) -> None:
        """On the load lane before any job: pay the scatter's first-use costs (the pinned host
        allocator of the index uploads, the gather and scatter kernels of both widths, loaded
        lazily by CUDA) on a few bytes, so the first staged load does not (on an H100 its first
        group landed 30-40 ms late without this: twenty-fifth session)."""
        import torch
        if self.area.numel() < 64:
            return
        dev = torch.device("cuda", self.device)
        stream = self.copier.streams[Direction.H2D]
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            for dtype in (torch.uint8, torch.int64):
                src = self.area[:64].view(dtype).view(2, -1)
                dst = torch.zeros_like(src)
                ids = self._upload(np.array([1, 0], dtype=np.int64))
                dst.index_copy_(0, ids, src.index_select(0, ids))
        stream.synchronize()
        self._uploads.synchronize()

    def can_scatter(self, region: CudaEngineRegion) -> str | None:
        """Why a staged load cannot be scattered into ``region`` (None: it can)."""
        if not self.copier.gather_views(region).ok:
            return "its layers' offsets or strides are not whole pages"
        return None

    def stage(self, host_addrs: Addrs, layout: StageLayout) -> None:
        """Group ``g < layout.staged`` of the slot at ``host_addrs[i]`` -> the area (issued on
        the load stream, not waited for)."""
        assert layout.nbytes <= self.area.numel(), "a layout over the staging area"
        base, p = self.area.data_ptr(), layout.page_bytes
        for g in range(layout.staged):
            first, _ = layout.pages(g)
            self.copier.issue_h2d(host_addrs + first * p, base + layout.block_offsets(g), layout.group_bytes(g))

    def scatter(self, region: CudaEngineRegion, blocks: EngineBlocks, layout: StageLayout, g: int) -> Any:
        """Staged group ``g`` of every block -> its pages of engine block ``blocks[i]``; the CUDA
        event of the scatter (a timing one)."""
        import torch
        views = self.copier.gather_views(region)
        region.check_blocks(blocks)  # the page indices below address the region's buffers
        stream = self.copier.streams[Direction.H2D]
        dev = torch.device("cuda", self.device)
        first, end = layout.pages(g)
        n, per = layout.blocks, end - first
        off = layout.group_offset(g)
        src = self.area[off:off + n * per * layout.page_bytes].view(n * per, layout.page_bytes)
        src = src.view(torch.int64) if views.wide else src
        work = []  # (pages view, destination page indices, source rows or None: all in order)
        with torch.cuda.device(dev), torch.cuda.stream(self._uploads):
            for ids, pages in views.groups:
                layers = ids[(ids >= first) & (ids < end)]
                if not len(layers):
                    continue
                dst = views.page_offset[layers][None, :] + blocks[:, None] * views.page_stride[layers][None, :]
                rows = (np.arange(n, dtype=np.int64)[:, None] * per + (layers - first)[None, :]).ravel()
                whole = len(layers) == per and views.single
                work.append((pages, self._upload(dst.ravel()), None if whole else self._upload(rows)))
            event: Any = torch.cuda.Event  # (untyped constructor)
            uploaded = event()
            uploaded.record(self._uploads)
        stream.wait_event(uploaded)
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            for pages, dst_idx, rows_idx in work:
                dst_idx.record_stream(stream)
                if rows_idx is None:
                    pages.index_copy_(0, dst_idx, src)
                else:
                    rows_idx.record_stream(stream)
                    pages.index_copy_(0, dst_idx, src.index_select(0, rows_idx))
        return self.copier.mark(Direction.H2D)

    def _upload(self, values: Addrs) -> Any:
        import torch
        return torch.from_numpy(np.ascontiguousarray(values)).pin_memory().to(
            torch.device("cuda", self.device), non_blocking=True)

    def close(self) -> None:
        self._uploads.synchronize()
        del self.area
