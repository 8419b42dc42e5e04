"""Cost-aware onboarding through the real daemons: a G3 hit that is slower to load than to
recompute is recomputed and promoted to G2, so the next lookup loads it from G2; without a
prefill estimate (DYN_KVBM_COST_AWARE_LOADS=false on the connector) it is loaded as before."""
from __future__ import annotations

import time

import numpy as np

from kvbm_client import Tier

from test_data_path import hashes, wait_counter  # type: ignore[import-not-found]

#: a disk that reads 1 KB/s (an 8 KiB shard takes 8 s) against a 1000 tokens/s engine (16 ms a block)
SLOW_DISK = dict(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="4", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="32",
                 DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER="true", DYN_KVBM_HOST_FREE_WATERMARK="0",
                 DYN_KVBM_DISK_LOAD_GBPS="0.000001")
PREFILL = 1000.0


def _g3_hit(make_node):
    """A node with a slow-disk prior and two blocks only in G3: (node, client, engine memory,
    their keys, their bytes)."""
    node = make_node(**SLOW_DISK)
    client, engines = node.ready_client()
    eng = engines["0"].array
    keys = hashes(2, 7)
    client.wait(client.offload(keys, [0, 1]))
    client.wait(client.offload(hashes(4, 8), [2, 3, 4, 5]))  # pushes both to G3
    assert client.match(keys, count_hit=False).tiers == (Tier.DISK, Tier.DISK)
    return node, client, eng, keys, eng[0:2].copy()


def test_slow_g3_hit_is_recomputed_promoted_then_loaded_from_g2(make_node):
    node, client, eng, keys, original = _g3_hit(make_node)

    handle = client.prepare_load(keys, count_hit=True, tokens_per_block=16, prefill_tokens_per_s=PREFILL)
    assert handle.is_empty and handle.skipped_cost == 2  # nothing pinned, nothing to start
    deadline = time.monotonic() + 10
    while client.match(keys, count_hit=False).tiers != (Tier.HOST, Tier.HOST) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.match(keys, count_hit=False).tiers == (Tier.HOST, Tier.HOST)  # promoted without a load
    assert wait_counter(node, "kvbm_promoted_blocks", 2)
    counters = node.status().counters
    assert counters["kvbm_onboard_skipped_blocks"] == 2 and counters["kvbm_onboard_blocks_d2d"] == 0

    eng[:] = 0
    handle = client.prepare_load(keys, count_hit=True, tokens_per_block=16, prefill_tokens_per_s=PREFILL)
    assert handle.num_blocks == 2 and handle.skipped_cost == 0  # G2 at 20 GB/s beats recomputing
    client.start(handle, [10, 11])
    client.wait(handle)
    assert np.array_equal(eng[10:12], original)
    assert wait_counter(node, "kvbm_onboard_blocks_h2d", 2)
    assert node.status().counters["kvbm_onboard_skipped_blocks"] == 2
    log = (node.root / "leader.log").read_text()
    assert "onboard decision job=" in log and "recompute: matched 2 blocks (0 G2, 2 G3, 32 tokens)" in log
    assert "load: matched 2 blocks (2 G2, 0 G3, 32 tokens)" in log


def test_without_an_estimate_the_g3_hit_is_loaded_as_before(make_node):
    node, client, eng, keys, original = _g3_hit(make_node)
    eng[:] = 0
    handle = client.prepare_load(keys, count_hit=True, tokens_per_block=16, prefill_tokens_per_s=0.0)
    assert handle.num_blocks == 2 and handle.skipped_cost == 0
    client.start(handle, [10, 11])
    client.wait(handle)
    assert np.array_equal(eng[10:12], original)
    assert wait_counter(node, "kvbm_onboard_blocks_d2d", 2)
    assert node.status().counters["kvbm_onboard_skipped_blocks"] == 0
    assert "no cost check" in (node.root / "leader.log").read_text()
