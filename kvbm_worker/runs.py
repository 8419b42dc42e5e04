"""Run arithmetic: merge unit-long copies that are adjacent on both sides into longer ones.

Pure numpy, used by every medium: the disk path merges consecutive slots into one I/O, the
GPU path merges pages into one DMA (:mod:`.handlers.cuda_copier`, :mod:`.handlers.pinned`).
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

Addrs = npt.NDArray[np.int64]


def segments(src: Addrs, dst: Addrs, unit: int, split: npt.NDArray[np.int64] | None = None
             ) -> tuple[Addrs, Addrs, Addrs]:
    """Merge unit-long copies ``src[i] -> dst[i]`` that are adjacent on both sides.

    ``split`` (optional, one id per copy) forbids merging across a change of id (separately
    pinned host ranges). Returns ``(src_starts, dst_starts, lengths)``.
    """
    n = len(src)
    if n == 0:
        return src, dst, np.zeros(0, np.int64)
    brk = np.ones(n, dtype=bool)
    brk[1:] = (src[1:] != src[:-1] + unit) | (dst[1:] != dst[:-1] + unit)
    if split is not None:
        brk[1:] |= split[1:] != split[:-1]
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n)).astype(np.int64) * unit
    return src[starts], dst[starts], lengths


def page_range(pages: tuple[int, int] | None, per_block: int) -> tuple[int, int]:
    """``pages`` (``[lo, hi)`` of a block's ``per_block`` pages; None: all of them), checked:
    raises ValueError for an empty range or one outside the block."""
    lo, hi = pages if pages is not None else (0, per_block)
    if not 0 <= lo < hi <= per_block:
        raise ValueError(f"pages [{lo}, {hi}) outside the region's {per_block} pages per block")
    return lo, hi


def chunks(n: int, per: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of at most ``per`` items covering ``0 .. n-1``."""
    per = max(1, per)
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)]
