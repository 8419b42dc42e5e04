"""A GPU worker's staging area (``kvbm-worker --gpu N --stage-mib M``) and its two copies: a
staged load's first layer group from pinned G2 slots into the area (DMA, before the engine's
blocks are known), then from the area into a CUDA IPC region's pages (one ``index_copy_`` per
staged group and buffer, once they are).

Runs on the load lane's thread. The staging copies are issued on the copier's load stream, an
event after each group's; a group's scatter runs on a stream of its own that waits for that
event (and for its index upload, on a third stream: an upload on the load stream would wait for
every copy queued there). So the load's other groups, copied straight into the engine's blocks on
the load stream behind the staging copies, never wait for a scatter: on the load stream the
scatter had held the link idle for its ~2 ms (H100, twenty-fifth session's worker logs: the
pieces after the staged group landed at the link's pace, 2.1-2.4 ms after it was in the area).

Ordering (what replaces the single stream's):

* a staged group's scatter reads the area only after that group's staging copies landed (its
  event), and writes only the pages of its layers, which no other copy of the load writes;
* the load's signal words wait for the last scatter issued too (``CudaMover._signal`` passes
  :attr:`CudaStage.last_scatter` to ``CudaCopier.write_word(after=...)``; the staged groups are
  the load's first pieces, so a staged group's word waits for its own scatter and every later
  word for all of them): an engine's layer wait never passes a staged group before its bytes
  are in the blocks;
* a new stage's copies into the area wait for the last scatter's event on the GPU, besides the
  runner releasing the area only once the taking job's copies (the scatters included) are done.

The layout is :mod:`..stages`'s. The scatter is one ``index_copy_`` per staged group and buffer
holding all its layers in order (a cross-layer buffer), else one per layer, its source a strided
view of the area (no gather into a temporary first); every index of a scatter goes up in one
upload.

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
    """The area (``nbytes`` on the copier's device) and its copies. Owns the area, the scatter
    stream, the upload stream and the events of the load in the area."""

    def __init__(self, copier: CudaCopier, nbytes: int) -> None:
        import torch
        self.copier = copier
        self.device = copier.device
        try:
            self.area = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
        except torch.OutOfMemoryError as exc:  # the operator's flag, named: not only torch's sizes
            raise MemoryError(f"the staging area (--stage-mib {nbytes / (1 << 20):g}) does not fit in cuda:"
                              f"{self.device}'s free memory; give a smaller --stage-mib, or 0 for none "
                              f"({str(exc).splitlines()[0]})") from exc
        stream: Any = torch.cuda.Stream  # (untyped constructor)
        self._uploads = stream(device=self.device)
        self._scatters = stream(device=self.device)
        self._ready: list[Any] = []  # per staged group of the load in the area: after its copies
        #: the last scatter's event: the area is read until it fired; the scatters run in order
        #: on one stream, so it fires after every earlier one
        self.last_scatter: Any = None

    def warm(self) -> None:
        """On the load lane before any job: pay the scatter's first-use costs (the pinned host
        allocator of the index uploads, the scatter kernels of both widths from a contiguous and
        a strided source, loaded lazily by CUDA) on a few bytes, so the first staged load does
        not (on an H100 its first group landed 30-40 ms late without this: twenty-fifth session)."""
        import torch
        if self.area.numel() < 128:
            return
        dev = torch.device("cuda", self.device)
        ids = self._upload(np.array([1, 0], dtype=np.int64))
        self._scatters.wait_stream(self._uploads)
        with torch.cuda.device(dev), torch.cuda.stream(self._scatters):
            for dtype in (torch.uint8, torch.int64):
                src = self.area[:128].view(dtype)
                dst = torch.zeros_like(src[:src.numel() // 2]).view(2, -1)
                dst.index_copy_(0, ids, src[:src.numel() // 2].view(2, -1))  # contiguous
                dst.index_copy_(0, ids, src.view(2, 2, -1)[:, 1])  # strided, as one layer of a group
        self._scatters.synchronize()
        self._uploads.synchronize()

    def can_scatter(self, region: CudaEngineRegion) -> str | None:
        """Why a staged load cannot be scattered into ``region`` (None: it can)."""
        if not self.copier.gather_views(region).ok:
            return "its layers' offsets or strides are not whole pages"
        return None

    def stage(self, host_addrs: Addrs, layout: StageLayout) -> None:
        """Group ``g < layout.staged`` of the slot at ``host_addrs[i]`` -> the area (issued on
        the load stream after the last scatter from the area, not waited for)."""
        assert layout.nbytes <= self.area.numel(), "a layout over the staging area"
        base, p = self.area.data_ptr(), layout.page_bytes
        load = self.copier.streams[Direction.H2D]
        if self.last_scatter is not None:
            self.copier.wait_for(load, self.last_scatter)
        self._ready = []
        for g in range(layout.staged):
            first, _ = layout.pages(g)
            self.copier.issue_h2d(host_addrs + first * p, base + layout.block_offsets(g), layout.group_bytes(g))
            self._ready.append(self.copier.record(load))

    def scatter(self, region: CudaEngineRegion, blocks: EngineBlocks, layout: StageLayout, g: int) -> Any:
        """Staged group ``g`` of every block -> its pages of engine block ``blocks[i]``, on the
        scatter stream once the group is in the area; the CUDA event of the scatter (a timing
        one, of the copier's kind)."""
        import torch
        assert g < len(self._ready), "a scatter of a group the area does not hold"
        views = self.copier.gather_views(region)
        region.check_blocks(blocks)  # the page indices below address the region's buffers
        dev = torch.device("cuda", self.device)
        first, end = layout.pages(g)
        n, per = layout.blocks, end - first
        off = layout.group_offset(g)
        src = self.area[off:off + n * per * layout.page_bytes].view(n, per, layout.page_bytes)
        src = src.view(torch.int64) if views.wide else src
        work: list[tuple[Any, Any, int, int]] = []  # (pages view, source, first index, count)
        parts: list[npt.NDArray[np.int64]] = []
        at = 0
        for ids, pages in views.groups:
            layers = ids[(ids >= first) & (ids < end)]
            if not len(layers):
                continue
            if len(layers) == per and views.single:  # the group's layers, in order: rows block-major
                dst = views.page_offset[layers][None, :] + blocks[:, None] * views.page_stride[layers][None, :]
                parts.append(dst.ravel())
                work.append((pages, src.view(n * per, -1), at, n * per))
                at += n * per
                continue
            for layer in layers:  # one layer: block i's page, a strided view of the area
                parts.append(views.page_offset[layer] + blocks * views.page_stride[layer])
                work.append((pages, src[:, layer - first], at, n))
                at += n
        index = self._upload(np.concatenate(parts))
        side = self._scatters
        side.wait_stream(self._uploads)
        self.copier.wait_for(side, self._ready[g])
        with torch.cuda.device(dev), torch.cuda.stream(side):
            index.record_stream(side)
            for pages, source, lo, count in work:
                pages.index_copy_(0, index[lo:lo + count], source)
        self.last_scatter = self.copier.record(side, timed=True)
        return self.last_scatter

    def _upload(self, values: Addrs) -> Any:
        import torch
        with torch.cuda.stream(self._uploads):
            return torch.from_numpy(np.ascontiguousarray(values)).pin_memory().to(
                torch.device("cuda", self.device), non_blocking=True)

    def close(self) -> None:
        self._uploads.synchronize()
        self._scatters.synchronize()
        del self.area
