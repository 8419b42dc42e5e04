"""Bounce buffers: page-aligned host rows through which one lane's G3 I/O of engine pages goes.

Runs in the worker daemon, owned by :class:`~kvbm_worker.mover.BlockMover` (one per lane).
Invariant: chunk ``k`` uses half ``k % 2``, so the engine copy of one chunk never touches the
rows the disk I/O of the next chunk is using.
"""
from __future__ import annotations

import mmap

import numpy as np
import numpy.typing as npt

Ids = npt.NDArray[np.int64]
Rows = npt.NDArray[np.uint8]


class BounceBuffer:
    """Page-aligned staging rows for one lane's disk I/O of engine pages, used in two halves:
    chunk ``k`` takes half ``k % 2``, so the engine copy of one chunk overlaps the disk I/O of
    the other (with one row there is one half and no overlap)."""

    def __init__(self, slot_bytes: int, num_rows: int) -> None:
        self._mmap = mmap.mmap(-1, slot_bytes * num_rows)
        self.slots: Rows = np.frombuffer(self._mmap, dtype=np.uint8).reshape(num_rows, slot_bytes)
        self.num_rows = num_rows

    @property
    def overlaps(self) -> bool:
        return self.num_rows >= 2

    @property
    def per_chunk(self) -> int:
        return max(1, self.num_rows // 2)

    def rows(self, chunk: int, count: int) -> Ids:
        first = (chunk % 2) * self.per_chunk if self.overlaps else 0
        return first + np.arange(count, dtype=np.int64)

    def address(self, rows: Ids) -> Ids:
        addrs: Ids = self.slots.ctypes.data + rows * self.slots.shape[1]
        return addrs

    def close(self) -> None:
        self.slots = np.zeros((0, 0), np.uint8)
        try:
            self._mmap.close()
        except BufferError:  # a stuck disk call still holds the rows: unmapped when it returns
            pass
