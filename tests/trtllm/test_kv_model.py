"""The driver's deterministic model and its paged KV pool (TensorRT-LLM's layout)."""
from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest
import torch

from .kv_model import POISON, KvGeometry, KvModel
from .paged_kv import PagedKvCache

G = KvGeometry(num_layers=3, num_kv_heads=4, head_dim=8, tokens_per_block=4, tp_size=2)


def seeds(model: KvModel, tokens, salt=None, lora=None) -> np.ndarray:
    out: list[int] = []
    model.extend_seeds(out, model.root_seed(salt, lora), list(tokens))
    return np.asarray(out, dtype=np.uint64)


def test_kv_of_a_position_depends_on_its_prefix_only():
    m = KvModel(G)
    a, b = m.expected(seeds(m, [1, 2, 3, 4, 5]), 0), m.expected(seeds(m, [1, 2, 9, 4, 5]), 0)
    assert torch.equal(a[:2], b[:2])
    assert not any(torch.equal(a[i], b[i]) for i in range(2, 5))
    assert torch.equal(a, KvModel(G).expected(seeds(m, [1, 2, 3, 4, 5]), 0)), "deterministic across instances"
    assert tuple(a.shape) == (5, 3, 2, 2, 8)
    assert torch.equal(m.expected(seeds(m, [1, 2, 3]), 1, layer=2), m.expected(seeds(m, [1, 2, 3]), 1)[:, 2])


def test_extend_seeds_continues_the_chain():
    m = KvModel(G)
    root = m.root_seed(None, None)
    part: list[int] = []
    m.extend_seeds(part, root, [4, 5])
    m.extend_seeds(part, root, [4, 5, 6, 7])
    assert np.array_equal(np.asarray(part, dtype=np.uint64), seeds(m, [4, 5, 6, 7]))


def test_salt_and_lora_change_the_kv():
    m = KvModel(G)
    plain = m.expected(seeds(m, [7, 8, 9]), 0)
    assert not torch.equal(plain, m.expected(seeds(m, [7, 8, 9], salt=5), 0))
    assert not torch.equal(plain, m.expected(seeds(m, [7, 8, 9], lora=3), 0))
    blind = KvModel(G, tenant_sensitive=False)
    assert torch.equal(blind.expected(seeds(blind, [7, 8, 9]), 0), blind.expected(seeds(blind, [7, 8, 9], salt=5), 0))
    assert not torch.equal(blind.expected(seeds(blind, [7, 8, 9]), 0),
                           blind.expected(seeds(blind, [7, 8, 9], lora=3), 0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_values_are_finite_distinct_per_rank_and_never_poison(dtype):
    g = KvGeometry(num_kv_heads=4, tp_size=2, dtype=dtype)
    m = KvModel(g)
    s = seeds(m, range(300))
    r0, r1 = m.expected(s, 0), m.expected(s, 1)
    assert torch.isfinite(r0.view(dtype)).all() and torch.isfinite(r1.view(dtype)).all()
    assert not (r0 == POISON).any()
    assert not torch.equal(r0, r1)


def test_next_token_reads_every_rank():
    m = KvModel(G, vocab_size=1000)
    assert m.next_token([1234, 10]) == 244
    assert m.next_token([1234, 11]) != m.next_token([1234, 10])


def test_pool_has_trtllm_layout_and_pages_are_heads_tokens_dim(tmp_path):
    cache = PagedKvCache(G, num_blocks=6, rank=1)
    try:
        assert tuple(cache.tensor.shape) == (6, 3, 2, 2 * 4 * 8)  # [blocks, layers, K|V, heads*tokens*dim]
        m = KvModel(G)
        values = m.expected(seeds(m, range(6)), 1, layer=2)[5:6]
        cache.write(2, [3, 1], 5, 6, values)  # position 5 = block table[1], offset 1
        page = cache.tensor[1, 2].view(torch.int16).view(2, 2, 4, 8)  # (K|V, heads, tokens, dim)
        assert torch.equal(page[:, :, 1, :], values[0])
        assert (page[:, :, 0, :] == POISON).all() and (cache.tensor[3].view(torch.int16) == POISON).all()
        assert torch.equal(cache.read([3, 1], 5, 6, layer=2), values)
        assert torch.equal(cache.read([3, 1], 5, 6)[:, 2], values)
    finally:
        cache.close()


def test_checksum_sees_every_element_and_poison_fills_whole_blocks(tmp_path):
    cache = PagedKvCache(G, num_blocks=3, rank=0)
    try:
        m = KvModel(G)
        for layer in range(3):
            cache.write(layer, [2, 0], 0, 6, m.expected(seeds(m, range(6)), 0, layer))
        before = cache.checksum([2, 0], 6)
        cache.tensor[0, 2, 1].view(torch.int16).view(2, 4, 8)[1, 1, 7] ^= 1  # position 5, layer 2, V
        assert cache.checksum([2, 0], 6) != before
        cache.poison([2])
        assert (cache.tensor[2].view(torch.int16) == POISON).all()
        assert not (cache.tensor[0].view(torch.int16) == POISON).all()
    finally:
        cache.close()


def test_cpu_pool_is_a_sealed_memfd_another_mapping_sees():
    """The connector hands this memfd to a kvbm worker daemon, which maps the same pages."""
    cache = PagedKvCache(G, num_blocks=4, rank=0)
    fd = cache.memfd
    try:
        assert fd is not None and fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        other = np.memmap(f"/proc/self/fd/{fd}", dtype=np.int16, mode="r+")
        other[7] = 1234
        assert int(cache.tensor.view(torch.int16).reshape(-1)[7]) == 1234
        del other
    finally:
        cache.close()
    assert cache.memfd is None
    with pytest.raises(OSError):
        os.fstat(fd)
    cache.close()  # idempotent
