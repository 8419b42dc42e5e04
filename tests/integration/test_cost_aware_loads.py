"""Cost-aware onboarding through the real daemons: a G3 hit that is slower to load than to
recompute is recomputed and promoted to G2, so the next lookup loads it from G2; without a
prefill estimate (DYN_KVBM_COST_AWARE_LOADS=false on the connector) it is loaded as before."""
from __future__ import annotations

import numpy as np

from kvbm_client import Tier

from test_data_path import two_blocks_in_g3, wait_counter, wait_tiers  # type: ignore[import-not-found]

#: a disk that reads 1 KB/s (an 8 KiB shard takes 8 s) against a 1000 tokens/s engine (16 ms a block)
SLOW_DISK = dict(DYN_KVBM_DISK_LOAD_GBPS="0.000001")
PREFILL = 1000.0


def test_slow_g3_hit_is_recomputed_promoted_then_loaded_from_g2(make_node):
    node, client, eng, keys, original = two_blocks_in_g3(make_node, **SLOW_DISK)

    handle = client.prepare_load(keys, count_hit=True, tokens_per_block=16, prefill_tokens_per_s=PREFILL)
    assert handle.is_empty and handle.skipped_cost == 2  # nothing pinned, nothing to start
    assert wait_tiers(client, keys, (Tier.HOST, Tier.HOST)) == (Tier.HOST, Tier.HOST)  # promoted without a load
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
    node, client, eng, keys, original = two_blocks_in_g3(make_node, **SLOW_DISK)
    eng[:] = 0
    handle = client.prepare_load(keys, count_hit=True, tokens_per_block=16, prefill_tokens_per_s=0.0)
    assert handle.num_blocks == 2 and handle.skipped_cost == 0
    client.start(handle, [10, 11])
    client.wait(handle)
    assert np.array_equal(eng[10:12], original)
    assert wait_counter(node, "kvbm_onboard_blocks_d2d", 2)
    assert node.status().counters["kvbm_onboard_skipped_blocks"] == 0
    assert "no cost check" in (node.root / "leader.log").read_text()
