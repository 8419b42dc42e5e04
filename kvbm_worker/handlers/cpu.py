"""CPU copies between a CPU engine's pages (mapped shared memory) and slot rows (host pool
or bounce buffer): the CPU medium of :class:`kvbm_worker.mover.BlockMover`.

Runs on the worker's lane threads. One vectorised gather/scatter per layer, not per block:
numpy releases the GIL for the bulk copy.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..regions import EngineRegion
from ..runs import page_range

Ids = npt.NDArray[np.int64]
Rows = npt.NDArray[np.uint8]


def gather(region: EngineRegion, engine_blocks: Ids, rows: Rows, picks: Ids) -> None:
    """``rows[picks[i]]`` <- every layer's page of engine block ``engine_blocks[i]``."""
    page = region.page_bytes
    for layer, view in enumerate(region.layer_views):
        rows[picks, layer * page:(layer + 1) * page] = view[engine_blocks]


def scatter(rows: Rows, picks: Ids, region: EngineRegion, engine_blocks: Ids,
            pages: tuple[int, int] | None = None) -> None:
    """Every layer's page (``pages``: those in ``[lo, hi)``) of engine block
    ``engine_blocks[i]`` <- ``rows[picks[i]]``."""
    page = region.page_bytes
    lo, hi = page_range(pages, len(region.layer_views))
    for layer in range(lo, hi):
        region.layer_views[layer][engine_blocks] = rows[picks, layer * page:(layer + 1) * page]
