"""The driver's device block allocator (TensorRT-LLM's V1 KV cache manager bookkeeping)."""
from __future__ import annotations

import pytest

from .block_pool import DeviceBlockPool, NoFreeBlocksError, chain_block_keys

B = 4


def keys(tokens, n, salt=None, lora=None):
    return chain_block_keys(list(tokens), B, n, salt, lora)


def test_a_returning_prefix_reuses_the_released_full_blocks():
    pool = DeviceBlockPool(8, B)
    tokens = list(range(10))
    first = pool.add_sequence(1, keys(tokens, 2), 3)
    assert first.num_matched_blocks == 0 and len(first.fresh_block_ids) == 3
    uncached = pool.release(1, keys(tokens, 2))
    assert uncached == [first.block_ids[2]], "the partial last block is not cached"
    again = pool.add_sequence(2, keys(tokens, 2), 3)
    assert again.num_matched_blocks == 2 and again.block_ids[:2] == first.block_ids[:2]
    assert pool.stats.reused_blocks == 2


def test_keys_cover_the_prefix_salt_and_adapter():
    assert keys([1, 2, 3, 4, 5, 6, 7, 8], 2)[1] != keys([9, 2, 3, 4, 5, 6, 7, 8], 2)[1]
    assert keys(range(4), 1) != keys(range(4), 1, salt=7)
    assert keys(range(4), 1) != keys(range(4), 1, lora=2)
    assert keys(range(8), 2) == keys(range(8), 2)


def test_a_referenced_block_is_never_handed_out_and_exhaustion_changes_nothing():
    pool = DeviceBlockPool(4, B)
    held = pool.add_sequence(1, [], 3)
    with pytest.raises(NoFreeBlocksError):
        pool.add_sequence(2, [], 2)
    assert pool.num_free_blocks == 1 and not pool.has_sequence(2)
    with pytest.raises(NoFreeBlocksError):
        pool.add_token(1, 5 * B)
    assert pool.get_cache_indices(1) == held.block_ids
    assert pool.add_token(1, 4 * B) != []


def test_eviction_takes_uncached_blocks_first_then_the_oldest_released_leaf():
    pool = DeviceBlockPool(6, B)
    a = list(range(100, 109))  # 2 full blocks + 1 token
    first = pool.add_sequence(1, keys(a, 2), 3)
    pool.release(1, keys(a, 2))
    second = pool.add_sequence(2, [], 4)  # 3 uncached + the partial block of seq 1 (uncached too)
    assert set(second.block_ids).isdisjoint(first.block_ids[:2]) and pool.stats.evicted_blocks == 0
    pool.add_token(2, 5 * B)  # one more: evicts the least recently released cached block, the leaf
    assert pool.stats.evicted_blocks == 1
    assert pool.match_prefix(keys(a, 2)) == first.block_ids[:1], "the root block survives"


def test_shared_blocks_are_counted_and_freed_by_the_last_holder():
    pool = DeviceBlockPool(6, B)
    tokens = list(range(9))
    pool.add_sequence(1, keys(tokens, 2), 3)
    pool.release(1, keys(tokens, 2))
    a = pool.add_sequence(2, keys(tokens, 2), 3)
    b = pool.add_sequence(3, keys(tokens, 2), 3)
    assert a.block_ids[:2] == b.block_ids[:2]
    free = pool.num_free_blocks
    pool.release(2, keys(tokens, 2))
    assert pool.num_free_blocks == free + 1, "only seq 2's own partial block became free"
    pool.release(3, keys(tokens, 2))
    assert pool.num_free_blocks == 6


def test_without_block_reuse_nothing_is_matched_and_freed_blocks_are_uncached():
    pool = DeviceBlockPool(4, B, enable_block_reuse=False)
    tokens = list(range(9))
    pool.add_sequence(1, keys(tokens, 2), 3)
    assert len(pool.release(1, keys(tokens, 2))) == 3
    assert pool.add_sequence(2, keys(tokens, 2), 3).num_matched_blocks == 0
