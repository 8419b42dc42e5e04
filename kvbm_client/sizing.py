"""How big a slot is and how many fit in a tier: the one rule the leader (pool plans), the
workers (allocation) and ``kvbm doctor`` share.

Pure arithmetic. A slot holds one worker's shard of one logical block (every layer's page),
rounded up to :data:`SLOT_ALIGN` so every slot is O_DIRECT-aligned. Pools are sized as Dynamo
sizes them, over the *allocated* bytes: ``slots = GB * 1e9 // (sum over the node's workers of
slot bytes)``, or the ``*_OVERRIDE_NUM_BLOCKS`` setting.
"""
from __future__ import annotations

SLOT_ALIGN = 4096


def align_up(n: int, alignment: int = SLOT_ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


def slot_bytes(block_bytes: int) -> int:
    """Bytes one slot takes in a worker's pool for a shard of ``block_bytes`` useful bytes."""
    return align_up(block_bytes)


def tier_slots(override_blocks: int | None, gb: float | None, bytes_per_block: int) -> int:
    """Slots of one tier: the override when set, else ``gb`` GB over ``bytes_per_block`` (the
    sum of every worker's :func:`slot_bytes`); 0 when the tier is off."""
    if override_blocks:
        return int(override_blocks)
    if not gb or bytes_per_block <= 0:
        return 0
    return int(gb * 1e9 // bytes_per_block)


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
