"""Typed arrays of ids, one entry per plan entry: the ids of :mod:`kvbm_client.ids`, vectorised.

``NewType``s over int64 arrays, so they cost nothing at run time and mypy refuses a slot
array where engine blocks are expected (the mix-up that would copy the wrong pages). Built
only from checked input (:mod:`kvbm_worker.plan_check`), so every entry is in range.
"""
from __future__ import annotations

from typing import NewType

import numpy as np
import numpy.typing as npt

#: :data:`~kvbm_client.ids.EngineBlockId` of each entry: a block of the engine's KV cache (G1).
EngineBlocks = NewType("EngineBlocks", npt.NDArray[np.int64])
#: :data:`~kvbm_client.ids.SlotId` of each entry: a slot of one worker tier (G2 or G3).
Slots = NewType("Slots", npt.NDArray[np.int64])

NO_BLOCKS = EngineBlocks(np.zeros(0, np.int64))
NO_SLOTS = Slots(np.zeros(0, np.int64))
