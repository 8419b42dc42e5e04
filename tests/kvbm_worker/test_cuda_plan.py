"""The GPU data path's pure parts, on CPU: run merging, layout description, lazy imports."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbm_client.cuda_export import page_placements
from kvbm_worker.runs import segments


def test_segments_merge_only_runs_adjacent_on_both_sides():
    src = np.array([0, 10, 20, 50, 60], np.int64)
    dst = np.array([100, 110, 120, 130, 140], np.int64)
    s, d, n = segments(src, dst, 10)
    assert s.tolist() == [0, 50] and d.tolist() == [100, 130] and n.tolist() == [30, 20]


def test_segments_split_at_pinned_range_boundaries():
    src = np.arange(0, 40, 10, dtype=np.int64)
    dst = np.arange(0, 40, 10, dtype=np.int64)
    s, d, n = segments(src, dst, 10, split=np.array([1, 1, 2, 2]))
    assert s.tolist() == [0, 20] and n.tolist() == [20, 20]
    assert segments(src[:0], dst[:0], 10)[2].size == 0


def test_cross_layer_layout_is_one_run_per_block():
    # [num_blocks=5, layers=3, kv=2, tokens=4, heads=2, dim=8] bf16
    shape = (5, 3, 2, 4, 2, 8)
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(6))
    n, page, pages = page_placements(shape, strides, 2, 0, block_dim=0, page_dims=3)
    assert (n, page, len(pages)) == (5, 4 * 2 * 8 * 2, 6)
    assert [o for o, _ in pages] == [i * page for i in range(6)]  # layer0.K, layer0.V, layer1.K, ...
    assert {st for _, st in pages} == {6 * page}
    g1 = np.array([o + 3 * st for o, st in pages], np.int64)  # block 3, every page
    host = 4096 + np.arange(6, dtype=np.int64) * page
    assert segments(g1, host, page)[2].tolist() == [6 * page]


def test_flash_attention_per_layer_layout():
    shape = (2, 7, 4, 2, 8)  # [kv, num_blocks, tokens, heads, dim]
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(5))
    n, page, pages = page_placements(shape, strides, 2, storage_offset=100, block_dim=1, page_dims=3)
    assert n == 7 and page == 128
    assert pages == [(200, 128), (200 + 7 * 128, 128)]


def test_non_contiguous_page_is_refused():
    with pytest.raises(ValueError, match="not contiguous"):
        page_placements((4, 2, 8), (1, 32, 4), 2, 0, block_dim=0, page_dims=2)
    with pytest.raises(ValueError, match="block_dim"):
        page_placements((4, 2, 8), (16, 8, 1), 2, 0, block_dim=1, page_dims=2)


def test_worker_parser_has_gpu_options_and_cpu_import_is_lazy():
    from kvbm_worker.daemon import build_parser
    args = build_parser().parse_args(["--gpu", "0", "--cuda-copy", "gather"])
    assert args.gpu == 0 and args.cuda_copy == "gather"
    assert build_parser().parse_args(["--cpu"]).gpu is None
    # a CPU worker imports its whole data path, the CUDA modules included, without CUDA
    probe = ("import sys, kvbm_worker.daemon, kvbm_worker.service, kvbm_worker.handlers.cuda; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'cuda', 'nixl', 'nixl_cu13')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported at start-up: {out.stdout}"


def test_runs_are_cut_at_pinned_range_edges():
    from kvbm_worker.handlers.pinned import PinnedHost
    pinned = PinnedHost(0)
    pinned._starts = np.array([1000, 1500, 3000], np.int64)  # three registrations, as pin() records them
    src = np.array([0, 5000], np.int64)
    dst = np.array([1200, 1400], np.int64)  # run 0: 1200..1800 crosses 1500; run 1: 1400..1450 does not
    s, d, n = pinned.split(src, dst, np.array([600, 50], np.int64), dst)
    assert d.tolist() == [1200, 1500, 1400] and s.tolist() == [0, 300, 5000] and n.tolist() == [300, 300, 50]
