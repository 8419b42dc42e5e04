"""The device block allocator of the driver: TensorRT-LLM's (V1) KV cache manager bookkeeping.

What it reproduces, because a connector's correctness depends on it:

* ``add_sequence`` matches the longest prefix of *full* blocks already cached on the device
  (partial-block reuse off, as the KVBM guide requires), over the first ``prompt_len - 1`` tokens
  only (the last prompt token is always computed), and allocates every other block of the prompt
  at once;
* ``add_token`` grows a running sequence one block at a time;
* ``store`` makes the full blocks a context pass completed matchable at once (TensorRT-LLM's
  ``update_resources`` calls ``store_context_blocks`` after every context pass);
* ``release`` stores the sequence's full blocks whose KV is complete (the first
  ``num_tokens - 1`` tokens) for reuse and drops the sequence's references, last block first;
* free blocks are handed out uncached ones first, then cached ones least recently released
  first, and a reclaimed cached block leaves the index (this is the eviction: a small pool
  forgets returning prefixes);
* a block with references is never handed out (the driver keeps the references of a request
  whose connector save is in flight until the connector reports it saved).

Pure bookkeeping: no tensors, no I/O. Block content is keyed by a hash chain over
``(cache salt, LoRA task, tokens)`` block by block, so different salts or adapters never match.
"""
from __future__ import annotations

import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NewType, Optional, Sequence

import xxhash

BlockId = NewType("BlockId", int)
BlockKey = NewType("BlockKey", int)


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for (the driver's scheduler prevents this)."""


def chain_block_keys(tokens: Sequence[int], tokens_per_block: int, num_blocks: int,
                     cache_salt_id: Optional[int], lora_task_id: Optional[int]) -> list[BlockKey]:
    """Keys of the first ``num_blocks`` full blocks of ``tokens`` (each key covers its prefix)."""
    assert num_blocks * tokens_per_block <= len(tokens)
    h = xxhash.xxh64_intdigest(struct.pack("<Qq", (cache_salt_id or 0) & (2**64 - 1),
                                           -1 if lora_task_id is None else lora_task_id))
    keys: list[BlockKey] = []
    for i in range(num_blocks):
        chunk = tokens[i * tokens_per_block:(i + 1) * tokens_per_block]
        h = xxhash.xxh64_intdigest(struct.pack(f"<Q{len(chunk)}q", h, *chunk))
        keys.append(BlockKey(h))
    return keys


@dataclass
class _Block:
    block_id: BlockId
    ref_count: int = 0
    key: Optional[BlockKey] = None


@dataclass
class SequenceAllocation:
    """Result of :meth:`DeviceBlockPool.add_sequence`.

    Attributes:
        block_ids: The sequence's blocks, in token order.
        num_matched_blocks: Leading blocks reused from the device cache.
        fresh_block_ids: Blocks newly handed out (their content is garbage).
    """

    block_ids: list[BlockId]
    num_matched_blocks: int
    fresh_block_ids: list[BlockId] = field(default_factory=list)


@dataclass
class PoolStats:
    reused_blocks: int = 0
    allocated_blocks: int = 0
    evicted_blocks: int = 0
    stored_blocks: int = 0


class DeviceBlockPool:
    """The device (G1) blocks of all ranks (ranks share one block table, as in TensorRT-LLM).

    Invariants: a block is in exactly one of {referenced, free uncached, free cached};
    ``_index[key]`` is a block whose ``key`` is ``key``; a referenced block is never handed out.
    """

    def __init__(self, num_blocks: int, tokens_per_block: int, enable_block_reuse: bool = True) -> None:
        self.num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        self.enable_block_reuse = enable_block_reuse
        self._blocks = [_Block(BlockId(i)) for i in range(num_blocks)]
        self._fresh: deque[BlockId] = deque(BlockId(i) for i in range(num_blocks))
        self._cached: OrderedDict[BlockId, None] = OrderedDict()  # least recently released first
        self._index: dict[BlockKey, BlockId] = {}
        self._seqs: dict[int, list[BlockId]] = {}
        self.stats = PoolStats()

    # --- queries ---
    @property
    def num_free_blocks(self) -> int:
        return len(self._fresh) + len(self._cached)

    def get_cache_indices(self, request_id: int) -> list[int]:
        """The request's block ids (``KVCacheManager.get_cache_indices``). KeyError if unknown."""
        return [int(b) for b in self._seqs[request_id]]

    def has_sequence(self, request_id: int) -> bool:
        return request_id in self._seqs

    def match_prefix(self, keys: Sequence[BlockKey]) -> list[BlockId]:
        """The cached blocks of the longest prefix of ``keys`` (no state change)."""
        matched: list[BlockId] = []
        if not self.enable_block_reuse:
            return matched
        for key in keys:
            block_id = self._index.get(key)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    # --- allocation ---
    def add_sequence(self, request_id: int, matchable_keys: Sequence[BlockKey], num_blocks: int) -> SequenceAllocation:
        """Allocate a new sequence of ``num_blocks`` blocks, reusing the cached prefix.

        Args:
            matchable_keys: Keys of the prompt's full blocks within its first ``prompt_len - 1``
                tokens (the only blocks TensorRT-LLM matches).
        Raises:
            NoFreeBlocksError: not enough free blocks; nothing is changed.
        """
        assert request_id not in self._seqs, f"request {request_id} already has a sequence"
        matched = self.match_prefix(matchable_keys)[:num_blocks]
        need = num_blocks - len(matched)
        free_after_match = self.num_free_blocks - sum(1 for b in matched if self._blocks[b].ref_count == 0)
        if need > free_after_match:
            raise NoFreeBlocksError(f"need {need} blocks, {free_after_match} free")
        for block_id in matched:
            self._ref(block_id)
        fresh = [self._take_free() for _ in range(need)]
        self._seqs[request_id] = matched + fresh
        self.stats.reused_blocks += len(matched)
        return SequenceAllocation(matched + fresh, len(matched), fresh)

    def add_token(self, request_id: int, num_tokens: int) -> list[BlockId]:
        """Grow the sequence to hold ``num_tokens`` tokens; returns the blocks added."""
        seq = self._seqs[request_id]
        need = -(-num_tokens // self.tokens_per_block) - len(seq)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {need} blocks, {self.num_free_blocks} free")
        added = [self._take_free() for _ in range(max(need, 0))]
        seq.extend(added)
        return added

    def store(self, request_id: int, full_block_keys: Sequence[BlockKey]) -> None:
        """Make a running sequence's complete full blocks matchable (``store_context_blocks``,
        called after every context pass); the sequence keeps its references."""
        if self.enable_block_reuse:
            for block_id, key in zip(self._seqs[request_id], full_block_keys):
                self._store(self._blocks[block_id], key)

    def release(self, request_id: int, full_block_keys: Sequence[BlockKey], drop_cached: bool = False) -> list[BlockId]:
        """Free a sequence: store its complete full blocks for reuse, drop its references.

        Args:
            full_block_keys: Keys of the sequence's full blocks whose KV is complete, in order.
            drop_cached: Blocks that become free leave the device cache too (as if reused at once).
        Returns:
            The blocks that became free *and* uncached (their content may be overwritten).
        """
        self.store(request_id, full_block_keys)
        seq = self._seqs.pop(request_id)
        uncached: list[BlockId] = []
        for block_id in reversed(seq):
            block = self._blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                if drop_cached and block.key is not None:
                    del self._index[block.key]
                    block.key = None
                if block.key is None:
                    self._fresh.appendleft(block_id)
                    uncached.append(block_id)
                else:
                    self._cached[block_id] = None
        return uncached

    # --- internals ---
    def _ref(self, block_id: BlockId) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._cached[block_id]
        block.ref_count += 1

    def _take_free(self) -> BlockId:
        if self._fresh:
            block_id = self._fresh.popleft()
        else:
            block_id, _ = self._cached.popitem(last=False)
            block = self._blocks[block_id]
            del self._index[block.key]
            block.key = None
            self.stats.evicted_blocks += 1
        self._blocks[block_id].ref_count = 1
        self.stats.allocated_blocks += 1
        return block_id

    def _store(self, block: _Block, key: BlockKey) -> None:
        assert block.key is None or block.key == key, "a block keeps the content it was stored with"
        if block.key is not None or key in self._index:
            return  # already stored, or the same content is cached in another block
        block.key = key
        self._index[key] = block.block_id
        self.stats.stored_blocks += 1
