"""Layer groups of a load: how a layer-grouped load (``TransferLayers``) is cut into pieces and
how far the lane queues them ahead of the one it waits for.

Runs in the worker daemon, on a lane thread (:class:`~.mover.BlockMover` executes the pieces).
Pure arithmetic and configuration.

Invariants: groups are outermost (every block's pages of group g are issued before any of
group g + 1), a piece holds one group's pages of consecutive blocks, and a piece is queued
only if every byte queued up to it would land before the job's time limit at
:data:`DMA_FLOOR_BPS` (so queuing ahead never lets a copy touch the engine's memory after its
deadline, which the connector relies on).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .jobs import PieceTimes
from .runs import chunks

PIECE_BYTES = 256 << 20  # default: a piece spans at most this much of one group's pages
GROUP_DEPTH = 3  # default: pieces queued behind the one the lane waits for
DMA_FLOOR_BPS = 1e9  # a pace far below any PCIe link's

#: (first block, end block, (first page, end page), the group's last piece)
Piece = tuple[int, int, tuple[int, int], bool]


@dataclass(frozen=True, slots=True)
class GroupPacing:
    """``kvbm-worker --load-piece-mb / --load-ahead``: pieces of at most ``piece_bytes`` of one
    group's pages; ``ahead`` pieces stay queued behind the one the lane waits for (0: all)."""

    piece_bytes: int = PIECE_BYTES
    ahead: int = GROUP_DEPTH

    def __post_init__(self) -> None:
        if self.piece_bytes <= 0 or self.ahead < 0:
            raise ValueError(f"piece_bytes must be > 0 and ahead >= 0, not {self.piece_bytes} and {self.ahead}")


@dataclass(frozen=True, slots=True)
class Grouping:
    """Run a load in page groups: ``bounds`` are the groups' end pages (increasing, the last
    one the region's pages per block); ``landed(end)`` is called on the lane thread once every
    block's pages ``[0, end)`` are in the engine's memory."""

    bounds: list[int]
    landed: Callable[[int], object]
    #: if given: each piece's :class:`~.jobs.PieceTimes`, appended on the lane (and the medium
    #: times its copies on the GPU too)
    pieces: list[PieceTimes] | None = None


def group_pieces(num_blocks: int, bounds: list[int], page_bytes: int, piece_bytes: int) -> list[Piece]:
    """The pieces of a load of ``num_blocks`` blocks in the groups ending at ``bounds``, in issue order."""
    pieces: list[Piece] = []
    for first, end in zip([0, *bounds[:-1]], bounds):
        spans = chunks(num_blocks, max(1, piece_bytes // ((end - first) * page_bytes)))
        pieces += [(lo, hi, (first, end), i == len(spans) - 1) for i, (lo, hi) in enumerate(spans)]
    return pieces
