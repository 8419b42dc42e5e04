"""Pool sizing: how many block slots a G2/G3 size gives for a node's layout.

Pure and synchronous; shared by the leader (which plans the pools) and ``kvbm doctor``
(which predicts them), so the two never disagree. The rule is Dynamo's: one logical block is
every worker's shard of it, so ``bytes per block = sum over workers of num_layers *
page_bytes`` and ``slots = GB * 1e9 // bytes per block``; an ``*_OVERRIDE_NUM_BLOCKS`` wins
over the GB figure. Each worker strides its slots at its shard size rounded up to
:data:`SLOT_ALIGN`, so a slot is O_DIRECT-aligned; that padding is what a tier really costs
in RAM or on disk beyond the GB figure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .config import KvbmConfig

#: Alignment of a worker's slot stride (O_DIRECT wants 4 KiB-aligned offsets and lengths).
SLOT_ALIGN = 4096


def slot_stride(shard_bytes: int) -> int:
    """Bytes between two slots of one worker: its shard rounded up to :data:`SLOT_ALIGN`."""
    return (shard_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def tier_slots(override: int | None, gb: float | None, block_bytes: int) -> int:
    """Slots of one tier: the override when set, else ``gb * 1e9 // block_bytes`` (0 when off)."""
    assert block_bytes > 0, "a logical block has at least one byte"
    if override:
        return int(override)
    return int(gb * 1e9 // block_bytes) if gb else 0


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """The pools a configuration gives for a node whose workers hold ``shard_bytes`` each."""

    shard_bytes: tuple[int, ...]  # per worker: num_layers * page_bytes
    host_slots: int
    disk_slots: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one logical block (every worker's shard)."""
        return sum(self.shard_bytes)

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot really takes over the node, alignment padding included."""
        return sum(slot_stride(b) for b in self.shard_bytes)

    @property
    def host_bytes(self) -> int:
        return self.host_slots * self.slot_bytes

    @property
    def disk_bytes(self) -> int:
        return self.disk_slots * self.slot_bytes


def pool_sizes(config: KvbmConfig, shard_bytes: Sequence[int]) -> PoolSizes:
    """Size G2 and G3 for workers whose shards of one block are ``shard_bytes`` long."""
    if not shard_bytes or min(shard_bytes) <= 0:
        raise ValueError(f"every worker's shard must be > 0 bytes, got {list(shard_bytes)}")
    total = sum(shard_bytes)
    return PoolSizes(tuple(int(b) for b in shard_bytes),
                     tier_slots(config.cpu_cache_override_num_blocks, config.cpu_cache_gb, total),
                     tier_slots(config.disk_cache_override_num_blocks, config.disk_cache_gb, total))
