"""Sequence hashing of token blocks (xxh3-64, chained, salted), as Dynamo KVBM does.

``block_hash(i) = xxh3_64(tokens of block i, seed=salt)``; the first block's sequence hash is
its block hash; block i's sequence hash is ``xxh3_64(seq(i-1) || block_hash(i), seed=salt)``.
So equal sequence hashes mean equal salt and equal tokens from the start of the request.
The salt folds in what must keep tenants apart (``cache_salt``, LoRA adapter, model).

Engines that already hash their blocks (vLLM's ``request.block_hashes``) pass those bytes
through :func:`engine_hashes` instead.
"""
from __future__ import annotations

from array import array
from typing import Iterable, Sequence

import xxhash

from .ids import MAX_HASH_BYTES, BlockHash

_U64 = (1 << 64) - 1


def salt_hash(*, model: str | None = None, cache_salt: str | None = None, lora_name: str | None = None) -> int:
    """Seed for :func:`sequence_hashes`; ``0`` when nothing is salted."""
    if model is None and cache_salt is None and lora_name is None:
        return 0
    text = "\x1f".join(x or "" for x in (model, cache_salt, lora_name))
    return xxhash.xxh3_64_intdigest(text.encode())


def _to_bytes(value: int) -> bytes:
    return (value & _U64).to_bytes(8, "big")


def sequence_hashes(tokens: Sequence[int], block_size: int, salt: int = 0,
                    parent: BlockHash | None = None) -> list[BlockHash]:
    """Sequence hashes of every *full* block of ``tokens``.

    Args:
        tokens: token ids of the request, from its start (or from ``parent``'s end).
        block_size: tokens per block.
        salt: seed from :func:`salt_hash`.
        parent: sequence hash of the block before ``tokens[0]``, to extend a known prefix.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    out: list[BlockHash] = []
    prev = int.from_bytes(parent, "big") if parent is not None else None
    seed = salt & _U64
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = array("I", tokens[start:start + block_size]).tobytes()
        bh = xxhash.xxh3_64_intdigest(chunk, seed=seed)
        seq = bh if prev is None else xxhash.xxh3_64_intdigest(_to_bytes(prev) + _to_bytes(bh), seed=seed)
        out.append(BlockHash(_to_bytes(seq)))
        prev = seq
    return out


def engine_hashes(hashes: Iterable[bytes | int]) -> list[BlockHash]:
    """Take an engine's own block hashes as given (bytes, or ints as 8 big-endian bytes)."""
    out: list[BlockHash] = []
    for h in hashes:
        b = _to_bytes(h) if isinstance(h, int) else bytes(h)
        if not 0 < len(b) <= MAX_HASH_BYTES:
            raise ValueError(f"block hash of {len(b)} bytes (1..{MAX_HASH_BYTES} allowed)")
        out.append(BlockHash(b))
    return out
