"""CPU copies between the engine's pages and block-sized slots (host pool or bounce buffer).

Runs on the worker's transfer threads. One vectorised gather/scatter per layer, not per
block: numpy releases the GIL for the bulk copy.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..regions import EngineRegion


def gather(region: EngineRegion, engine_blocks: Sequence[int], slots: np.ndarray, rows: Sequence[int]) -> None:
    """``slots[rows[i]]`` <- every layer's page of engine block ``engine_blocks[i]``."""
    blocks = np.asarray(engine_blocks, dtype=np.int64)
    idx = np.asarray(rows, dtype=np.int64)
    page = region.page_bytes
    for layer, view in enumerate(region.layer_views):
        slots[idx, layer * page:(layer + 1) * page] = view[blocks]


def scatter(slots: np.ndarray, rows: Sequence[int], region: EngineRegion, engine_blocks: Sequence[int]) -> None:
    """Every layer's page of engine block ``engine_blocks[i]`` <- ``slots[rows[i]]``."""
    blocks = np.asarray(engine_blocks, dtype=np.int64)
    idx = np.asarray(rows, dtype=np.int64)
    page = region.page_bytes
    for layer, view in enumerate(region.layer_views):
        view[blocks] = slots[idx, layer * page:(layer + 1) * page]
