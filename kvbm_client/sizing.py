"""How big a slot is and how many fit in a tier: the one rule the leader (pool plans), the
workers (allocation) and ``kvbm doctor`` (predictions) share, so they never disagree.

Pure arithmetic. A slot holds one worker's shard of one logical block (every layer's page),
rounded up to :data:`SLOT_ALIGN` so every slot is O_DIRECT-aligned. Pools are sized as Dynamo
sizes them, but over the bytes a block really *takes*: ``slots = GB * 1e9 // (sum over the
node's workers of slot bytes)``, or the ``*_OVERRIDE_NUM_BLOCKS`` setting. (Counting the
unaligned shard instead once let a tiny layout grow G2 4096-fold.) A worker's staging area
(``--stage-mib``) is bounded here too, for the worker, ``kvbm serve`` and ``kvbm doctor`` alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .config import KvbmConfig
from .errors import KvbmConfigError

#: The largest staging area a worker takes (``kvbm-worker --stage-mib``, ``kvbm serve --stage-mib``).
MAX_STAGE_MIB = 64 << 10

#: Alignment of a worker's slot stride (O_DIRECT wants 4 KiB-aligned offsets and lengths).
SLOT_ALIGN = 4096


def align_up(n: int, alignment: int = SLOT_ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


def stage_bytes(mib: float) -> int:
    """A staging area's bytes for ``--stage-mib`` (0: none), or :class:`KvbmConfigError`."""
    if not 0 <= mib <= MAX_STAGE_MIB:
        raise KvbmConfigError(f"--stage-mib must be in [0, {MAX_STAGE_MIB}], got {mib:g}")
    return int(mib * (1 << 20))


def slot_bytes(shard_bytes: int) -> int:
    """Bytes one slot takes in a worker's pool for a shard of ``shard_bytes`` useful bytes."""
    return align_up(shard_bytes)


def tier_slots(override: int | None, gb: float | None, bytes_per_block: int) -> int:
    """Slots of one tier: the override when set, else ``gb`` GB over ``bytes_per_block`` (the
    sum of every worker's :func:`slot_bytes`); 0 when the tier is off."""
    if override:
        return int(override)
    if not gb or bytes_per_block <= 0:
        return 0
    return int(gb * 1e9 // bytes_per_block)


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """The pools a configuration gives for a node whose workers hold ``shard_bytes`` each."""

    shard_bytes: tuple[int, ...]  # per worker: num_layers * page_bytes
    host_slots: int
    disk_slots: int

    @property
    def block_bytes(self) -> int:
        """Useful bytes of one logical block (every worker's shard)."""
        return sum(self.shard_bytes)

    @property
    def slot_bytes(self) -> int:
        """Bytes one logical block takes over the node, alignment padding included."""
        return sum(slot_bytes(b) for b in self.shard_bytes)

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
    total = sum(slot_bytes(b) for b in shard_bytes)
    return PoolSizes(tuple(int(b) for b in shard_bytes),
                     tier_slots(config.cpu_cache_override_num_blocks, config.cpu_cache_gb, total),
                     tier_slots(config.disk_cache_override_num_blocks, config.disk_cache_gb, total))


# ---------------------------------------------------------------------------- layout bounds
#: Largest shard of one block one worker may hold (every layer's page of one engine block).
MAX_SHARD_BYTES = 1 << 32
#: Most engine (G1) blocks one layout may declare.
MAX_ENGINE_BLOCKS = 1 << 24


def tier_problem(label: str, env: str, override_blocks: int | None, gb: float | None,
                 bytes_per_block: int) -> str | None:
    """Why a configured tier cannot be planned over ``bytes_per_block`` (the sum of every
    worker's :func:`slot_bytes`), or None: it would hold 0 blocks, or more bytes than its GB."""
    if not override_blocks and not gb:
        return None  # the tier is off
    slots = tier_slots(override_blocks, gb, bytes_per_block)
    if slots <= 0:
        return (f"{label} would hold 0 blocks: one block takes {bytes_per_block} bytes over the node's "
                f"workers (slots aligned to {SLOT_ALIGN}) and {env}={gb:g} allows {int((gb or 0) * 1e9)} bytes")
    if not override_blocks and gb and slots * bytes_per_block > gb * 1e9:
        return (f"{label} would take {slots} x {bytes_per_block} bytes, more than {env}={gb:g} "
                f"({int(gb * 1e9)} bytes)")
    return None
