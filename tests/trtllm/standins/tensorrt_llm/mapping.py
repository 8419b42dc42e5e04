"""STAND-IN for ``tensorrt_llm.mapping``: where a rank sits in the parallel layout (TP only)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    """``tensorrt_llm.mapping.Mapping`` reduced to tensor parallelism (no PP/CP/DP)."""

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size
