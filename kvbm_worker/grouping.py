"""Layer groups of a load: where a layer-grouped load (``TransferLayers``) is split into groups
of pages, how each group is cut into pieces, and how far the lane queues them ahead of the one
it waits for.

Runs in the worker daemon (the job runner takes the bounds, a lane thread runs the pieces:
:class:`~.mover.BlockMover`). Pure arithmetic and configuration.

Invariants: groups are outermost (every block's pages of group g are issued before any of
group g + 1), none is empty, a piece holds one group's pages of consecutive blocks, and a
piece is queued only if every byte queued up to it would land before the job's time limit at
:data:`DMA_FLOOR_BPS` (so queuing ahead never lets a copy touch the engine's memory after its
deadline, which the connector relies on).

Why the groups shrink and the first pieces grow (H100, 2026-11-26, ``results/*_2026-11-26*``):
the copy itself runs at the DMA's pace, but after the last group landed the engine still has
to launch that group's layers (eager vLLM: 4-6 ms after the last of six equal groups); and the
first byte moves only once the first piece is issued (a 256 MiB piece took the lane 3-6 ms to
issue beside vLLM). So the last group is about one layer and the first pieces are small.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from kvbm_client.ids import PlanKind, Tier
from kvbm_client.layer_groups import group_bounds as group_bounds  # (its home: the engine side uses it too)

from .jobs import PieceTimes
from .plan_check import Batch
from .signals import JobSignals

PIECE_BYTES = 256 << 20  # default: a piece spans at most this much of one group's pages
RAMP = 3  # the first piece of a load is PIECE_BYTES >> RAMP, the next ones double up to PIECE_BYTES
GROUP_DEPTH = 3  # default: pieces queued behind the one the lane waits for
DMA_FLOOR_BPS = 1e9  # a pace far below any PCIe link's

#: (first block, end block, (first page, end page), the group's last piece)
Piece = tuple[int, int, tuple[int, int], bool]


class GroupShape(str, enum.Enum):
    """``kvbm-worker --load-group-shape``."""

    FRONT = "front"  # shrinking groups, the last about P / groups**2 pages (:func:`group_bounds`)
    EVEN = "even"  # equal groups (as before 2026-11-26)


@dataclass(frozen=True, slots=True)
class GroupPacing:
    """``kvbm-worker --load-group-shape / --load-piece-mb / --load-ahead``: groups shaped by
    ``shape``; pieces of at most ``piece_bytes`` of one group's pages; ``ahead`` pieces stay
    queued behind the one the lane waits for (0: all)."""

    piece_bytes: int = PIECE_BYTES
    ahead: int = GROUP_DEPTH
    shape: GroupShape = GroupShape.FRONT

    def __post_init__(self) -> None:
        if self.piece_bytes <= 0 or self.ahead < 0:
            raise ValueError(f"piece_bytes must be > 0 and ahead >= 0, not {self.piece_bytes} and {self.ahead}")

    def bounds(self, pages_per_block: int, groups: int) -> list[int]:
        """The end page of each group of a load in ``groups`` groups."""
        if self.shape is GroupShape.EVEN:
            return even_bounds(pages_per_block, groups)
        return group_bounds(pages_per_block, groups)


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
    #: the engine's signal words the load writes as its groups land (:mod:`.signals`)
    signals: JobSignals | None = None


def even_bounds(pages_per_block: int, groups: int) -> list[int]:
    """Equal groups: group ``g`` is pages ``[g * P // groups, (g + 1) * P // groups)``."""
    groups = max(1, min(groups, pages_per_block))
    return [(g + 1) * pages_per_block // groups for g in range(groups)]


def group_pieces(num_blocks: int, bounds: list[int], page_bytes: int, piece_bytes: int) -> list[Piece]:
    """The pieces of a load of ``num_blocks`` blocks in the groups ending at ``bounds``, in issue
    order. A piece holds at most ``piece_bytes`` (at least one block's pages of its group); the
    first ones start at ``piece_bytes >> RAMP`` and double, so the DMA starts after a short issue
    and each next piece is issued while the one before is copied."""
    pieces: list[Piece] = []
    cap = max(1, piece_bytes >> RAMP)
    for first, end in zip([0, *bounds[:-1]], bounds):
        unit = (end - first) * page_bytes  # one block's pages of this group
        lo = 0
        while lo < num_blocks:
            hi = min(num_blocks, lo + max(1, cap // unit))
            pieces.append((lo, hi, (first, end), hi == num_blocks))
            lo, cap = hi, min(piece_bytes, cap * 2)
    return pieces


def groupable(batch: Batch) -> bool:
    """Whether ``batch`` may run in layer groups: a LOAD whose entries are all in G2 (a G3
    read lands whole blocks through the bounce buffer)."""
    return batch.kind is PlanKind.LOAD and not len(batch.entries(Tier.DISK)[0])
