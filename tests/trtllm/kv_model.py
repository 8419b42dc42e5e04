"""The deterministic "model" of the driver: the KV each position holds and the next token.

A real model's K and V at position ``p`` depend only on the tokens ``0..p`` (causal attention),
on the weights (a LoRA adapter changes them) and on the layer. This model keeps exactly that
dependency and nothing else: position ``p`` has a 64-bit *seed*, a hash chain over
``(root, tokens[0..p])``, and every element of its K/V in every layer and head is a fixed
function of that seed and the element's coordinates. So "what recompute writes" is known for
every byte, whichever process or pass computes it.

The next token is a function of the KV bytes actually present in the paged pool (a weighted sum
over every layer, head and position, summed over the ranks), so a wrong byte anywhere in a
request's blocks changes its output, as it would in a real model.

Values are 16-bit patterns with bit 14 clear, which for float16 and bfloat16 is always a finite
number; :data:`POISON` has bit 14 set, so a poisoned element never equals an expected one.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import xxhash

#: The int16 pattern freed and freshly allocated blocks are filled with (bit 14 set).
POISON = 0x5A5A

_C0 = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_VALUE_MASK = np.uint64(0xBFFF)
_ROOT_TAG = b"kvbm-trtllm-model-v1"


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic)."""
    z = z + _C0
    z = (z ^ (z >> np.uint64(30))) * _C1
    z = (z ^ (z >> np.uint64(27))) * _C2
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class KvGeometry:
    """Shape of the model's KV cache. ``num_kv_heads`` is the total; each of the ``tp_size``
    ranks holds ``num_kv_heads // tp_size`` of them (TensorRT-LLM shards KV heads under TP)."""

    num_layers: int = 4
    num_kv_heads: int = 4
    head_dim: int = 16
    tokens_per_block: int = 8
    tp_size: int = 1
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        assert self.num_kv_heads % self.tp_size == 0, "KV heads must split evenly over the TP ranks"
        assert torch.empty((), dtype=self.dtype).element_size() == 2, "the model writes 16-bit values"

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.tp_size

    @property
    def block_elems(self) -> int:
        """Elements of one (block, layer, K|V) page: ``heads * tokens_per_block * head_dim``."""
        return self.heads_per_rank * self.tokens_per_block * self.head_dim

    def pool_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """TensorRT-LLM's primary pool: ``[num_blocks, num_layers, 2, block_elems]``."""
        return (num_blocks, self.num_layers, 2, self.block_elems)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block on one rank (all layers, K and V)."""
        return self.num_layers * 2 * self.block_elems * 2


class KvModel:
    """The expected KV of any position and the next token of any sequence (pure, no I/O).

    Args:
        geometry: The KV shape.
        vocab_size: Tokens are ``0 .. vocab_size - 1``.
        tenant_sensitive: Mix the cache salt into the seeds. A real salt does not change the KV;
            NOTE: it is mixed in by default so that a block shared across salts fails the byte
            check instead of passing it silently (the LoRA id is always mixed in: an adapter does
            change the KV).
    """

    def __init__(self, geometry: KvGeometry, vocab_size: int = 1000, tenant_sensitive: bool = True) -> None:
        self.geometry = geometry
        self.vocab_size = vocab_size
        self.tenant_sensitive = tenant_sensitive
        g = geometry
        element = np.arange(g.num_layers * 2 * g.num_kv_heads * g.head_dim, dtype=np.uint64)
        table = mix64(element ^ np.uint64(0xA0761D6478BD642F)).reshape(g.num_layers, 2, g.num_kv_heads, g.head_dim)
        h = g.heads_per_rank
        self._tables = [np.ascontiguousarray(table[:, :, r * h:(r + 1) * h, :]) for r in range(g.tp_size)]

    def root_seed(self, cache_salt_id: Optional[int], lora_task_id: Optional[int]) -> int:
        salt = (cache_salt_id or 0) if self.tenant_sensitive else 0
        lora = -1 if lora_task_id is None else lora_task_id
        return xxhash.xxh64_intdigest(_ROOT_TAG + struct.pack("<Qq", salt & (2**64 - 1), lora))

    @staticmethod
    def extend_seeds(seeds: list[int], root: int, tokens: Sequence[int]) -> None:
        """Append the seeds of ``tokens[len(seeds):]`` to ``seeds`` (the chain of ``root``)."""
        h = seeds[-1] if seeds else root
        for token in tokens[len(seeds):]:
            h = xxhash.xxh64_intdigest(struct.pack("<QQ", h, token))
            seeds.append(h)

    def expected(self, seeds: np.ndarray, rank: int, layer: Optional[int] = None) -> torch.Tensor:
        """The int16 KV of the positions whose seeds are given, on ``rank``.

        Returns:
            Shape ``(P, 2, heads, head_dim)`` for one layer, ``(P, L, 2, heads, head_dim)`` for all.
        """
        table = self._tables[rank] if layer is None else self._tables[rank][layer]
        z = mix64(np.asarray(seeds, dtype=np.uint64).reshape((-1,) + (1,) * table.ndim) ^ table[None])
        return torch.from_numpy((z & _VALUE_MASK).astype(np.uint16).view(np.int16))

    def next_token(self, rank_checksums: Sequence[int]) -> int:
        """The token sampled from the sequence whose per-rank KV checksums are given."""
        return int(sum(rank_checksums) % self.vocab_size)
