"""Bytes through the real daemons: offload, overwrite, onboard elsewhere, compare."""
from __future__ import annotations

import urllib.request

import numpy as np
import pytest

from kvbm_client import Tier, sequence_hashes



def wait_counter(node, name: str, value: float, timeout: float = 10.0) -> bool:
    """Loads are confirmed to the leader beside the answer to the client: poll briefly."""
    import time
    end = time.monotonic() + timeout
    while node.status().counters[name] != value and time.monotonic() < end:
        time.sleep(0.02)
    return node.status().counters[name] == value


def hashes(n: int, seed: int = 0, block: int = 16):
    return sequence_hashes([seed * 1_000_003 + i for i in range(n * block)], block)


#: G2 of 4 blocks over a G3 of 32, every evicted block offloaded to G3
SMALL_G2 = dict(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="4", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="32",
                DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER="true", DYN_KVBM_HOST_FREE_WATERMARK="0")


def two_blocks_in_g3(make_node, **settings):
    """A :data:`SMALL_G2` node (plus ``settings``) with two blocks stored from engine blocks
    0-1 and pushed to G3 by four more: (node, client, engine memory, their keys, their bytes)."""
    node = make_node(**SMALL_G2, **settings)
    client, engines = node.ready_client()
    eng = engines["0"].array
    keys = hashes(2, 7)
    client.wait(client.offload(keys, [0, 1]))
    client.wait(client.offload(hashes(4, 8), [2, 3, 4, 5]))  # pushes both to G3
    assert client.match(keys, count_hit=False).tiers == (Tier.DISK, Tier.DISK)
    return node, client, eng, keys, eng[0:2].copy()


def wait_tiers(client, keys, tiers: tuple, timeout: float = 10.0) -> tuple:
    """The tiers ``keys`` match in once they are ``tiers`` (a promotion runs beside the
    answer to the load that caused it), or after ``timeout``."""
    import time
    end = time.monotonic() + timeout
    while client.match(keys, count_hit=False).tiers != tiers and time.monotonic() < end:
        time.sleep(0.05)
    return client.match(keys, count_hit=False).tiers


def test_offload_overwrite_onboard_into_other_blocks_two_workers(make_node):
    node = make_node(num_workers=2)
    client, engines = node.ready_client()
    keys = hashes(12)
    src = list(range(12))
    original = {w: e.array[src].copy() for w, e in engines.items()}
    res = client.wait(client.offload(keys, src))
    assert res.num_blocks == 12 and res.bytes == 2 * 12 * 4 * 2048  # summed over both workers
    assert client.match(keys).tiers == (Tier.HOST,) * 12
    for e in engines.values():
        e.array[:] = 0  # the engine reuses its memory
    dst = list(range(40, 52))
    handle = client.onboard(keys, dst)
    assert handle.num_blocks == 12
    client.wait(handle)
    for w, e in engines.items():
        assert np.array_equal(e.array[dst], original[w]), f"worker {w} onboarded wrong bytes"
        assert not e.array[:40].any(), "an onboard wrote outside its destination blocks"
    assert node.status().counters["kvbm_offload_blocks_d2h"] == 12
    assert wait_counter(node, "kvbm_onboard_blocks_h2d", 12)


def test_prefix_match_and_partial_onboard(make_node):
    node = make_node()
    client, engines = node.ready_client()
    keys = hashes(8)
    client.wait(client.offload(keys[:5], list(range(5))))
    assert client.match(keys).num_matched == 5
    other = hashes(8, seed=9)
    assert client.match(other).num_matched == 0
    handle = client.onboard(keys, list(range(20, 28)))
    assert handle.num_blocks == 5
    client.wait(handle)
    assert np.array_equal(engines["0"].array[20:25], engines["0"].array[0:5])


def test_offload_of_present_blocks_is_skipped(make_node):
    node = make_node()
    client, _ = node.ready_client()
    keys = hashes(4)
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    again = client.offload(keys + hashes(2, seed=5), [0, 1, 2, 3, 4, 5])
    assert again.skipped_present == 4 and again.num_blocks == 2 and again.indices == (4, 5)
    client.wait(again)


def test_full_tier_is_a_counted_skip_not_an_error(make_node):
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="4")
    client, _ = node.ready_client()
    first = client.offload(hashes(4), [0, 1, 2, 3])
    # While the first batch is pending (not yet confirmed), its slots cannot be evicted.
    second = client.offload(hashes(3, seed=2), [4, 5, 6])
    assert second.skipped_full == 3 and second.is_empty
    client.wait(first)
    assert node.status().counters["kvbm_offload_skipped_full"] == 3


def test_a_store_writes_at_most_its_demotion_budget_to_g3(make_node):
    """DYN_KVBM_STORE_DEMOTION_MB bounds the G2 -> G3 copies one offload carries (each makes
    the engine's blocks wait for the disk): 0.01 MB is one block of this layout; the other
    blocks the store evicts are dropped and counted."""
    node = make_node(**SMALL_G2, DYN_KVBM_STORE_DEMOTION_MB="0.01")
    client, _ = node.ready_client()
    first = hashes(4, 7)
    client.wait(client.offload(first, [0, 1, 2, 3]))
    client.wait(client.offload(hashes(4, 8), [4, 5, 6, 7]))  # evicts all four, one goes to G3
    assert [client.match([k], count_hit=False).tiers for k in first] == [(Tier.DISK,), (), (), ()]
    counters = node.status().counters
    assert counters["kvbm_offload_skipped_demotions"] == 3
    assert counters["kvbm_offload_blocks_h2d"] == 1 and counters["kvbm_evicted_blocks"] == 3


def test_a_loads_hit_counts_for_the_disk_offload_filter(make_node):
    """The leader counts a ``PrepareLoad``'s hit after it answered (off the lookup's critical
    path); it still makes the loaded blocks frequent: under G2 pressure they go to G3 and a
    one-off block does not."""
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="8", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="32",
                     DYN_KVBM_HOST_FREE_WATERMARK="0")
    client, _ = node.ready_client()
    loaded, one_off, filler = hashes(4, 11), hashes(4, 12), hashes(8, 13)
    client.wait(client.offload(loaded, [0, 1, 2, 3]))
    client.wait(client.offload(one_off, [4, 5, 6, 7]))
    handle = client.prepare_load(loaded, count_hit=True, tokens_per_block=16)
    assert handle.num_blocks == 4
    client.release(handle)  # (not copied: the hit is what counts)
    client.wait(client.offload(filler, list(range(8, 16))))  # G2 full: evicts all eight
    assert client.match(loaded, count_hit=False).tiers == (Tier.DISK,) * 4
    assert client.match(one_off, count_hit=False).num_matched == 0, "a one-off block was written to disk"


@pytest.mark.parametrize("filter_disabled", [False, True])
def test_g2_pressure_moves_frequent_blocks_to_g3(make_node, filter_disabled):
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="8", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="32",
                     DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER="true" if filter_disabled else "false",
                     DYN_KVBM_HOST_FREE_WATERMARK="0")
    client, engines = node.ready_client()
    eng = engines["0"].array
    frequent, one_off, filler = hashes(4, 1), hashes(4, 2), hashes(8, 3)
    client.wait(client.offload(frequent, [0, 1, 2, 3]))
    client.wait(client.offload(one_off, [4, 5, 6, 7]))
    assert client.match(frequent).num_matched == 4  # a hit: frequency 1 -> 2
    original = eng[0:8].copy()
    client.wait(client.offload(filler, list(range(8, 16))))  # G2 full: evicts all eight
    got_frequent = client.match(frequent, count_hit=False)
    got_one_off = client.match(one_off, count_hit=False)
    assert got_frequent.tiers == (Tier.DISK,) * 4
    if filter_disabled:
        assert got_one_off.tiers == (Tier.DISK,) * 4
    else:
        assert got_one_off.num_matched == 0, "a one-off block was written to disk"
    assert node.status().counters["kvbm_offload_blocks_h2d"] == (8 if filter_disabled else 4)
    eng[:] = 0
    client.wait(client.onboard(frequent, [30, 31, 32, 33]))
    assert np.array_equal(eng[30:34], original[0:4])
    assert wait_counter(node, "kvbm_onboard_blocks_d2d", 4)


def test_disk_only_mode_goes_device_to_disk(make_node):
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="16")
    client, engines = node.ready_client()
    status = node.status()
    assert [Tier(t.tier) for t in status.tiers] == [Tier.DISK]
    keys = hashes(6)
    original = engines["0"].array[0:6].copy()
    client.wait(client.offload(keys, list(range(6))))
    assert client.match(keys).tiers == (Tier.DISK,) * 6
    engines["0"].array[:] = 0
    client.wait(client.onboard(keys, list(range(10, 16))))
    assert np.array_equal(engines["0"].array[10:16], original)
    assert wait_counter(node, "kvbm_onboard_blocks_d2d", 6)
    counters = node.status().counters
    assert counters["kvbm_offload_blocks_d2d"] == 6 and counters["kvbm_offload_blocks_d2h"] == 0
    files = list(node.disk_dir.glob("kvbm-disk-cache-*"))
    assert len(files) == 1 and files[0].stat().st_size >= 16 * 4 * 2048


def test_preadv_fallback_without_nixl(make_node):
    node = make_node(start=False, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="",
                     DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="8")
    node.start_leader()
    node.start_worker("0", "--no-nixl")
    node.wait_attached()
    client, engines = node.ready_client()
    keys = hashes(3)
    original = engines["0"].array[0:3].copy()
    client.wait(client.offload(keys, [0, 1, 2]))
    engines["0"].array[:] = 0
    client.wait(client.onboard(keys, [5, 6, 7]))
    assert np.array_equal(engines["0"].array[5:8], original)
    assert "posix-pwritev" in (node.root / "worker-0.log").read_text()


def test_metrics_endpoint_serves_dynamo_names(make_node, free_port):
    port = free_port()
    node = make_node(DYN_KVBM_METRICS="true", DYN_KVBM_METRICS_PORT=str(port))
    client, _ = node.ready_client()
    keys = hashes(3)
    client.wait(client.offload(keys, [0, 1, 2]))
    client.match(keys, tokens_per_block=16)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in ("kvbm_matched_tokens", "kvbm_offload_blocks_d2h", "kvbm_offload_blocks_h2d",
                 "kvbm_offload_blocks_d2d", "kvbm_onboard_blocks_h2d", "kvbm_onboard_blocks_d2d",
                 "kvbm_host_cache_hit_rate", "kvbm_disk_cache_hit_rate", "kvbm_pool_used_blocks"):
        assert f"\n{name}" in body, name
    assert "kvbm_matched_tokens 48.0" in body
    assert "kvbm_offload_blocks_d2h 3.0" in body
    assert "kvbm_host_cache_hit_rate 1.0" in body


def test_debug_log_shows_every_decision(make_node):
    node = make_node()
    client, _ = node.ready_client()
    keys = hashes(2)
    client.wait(client.offload(keys, [0, 1]))
    client.wait(client.onboard(keys, [5, 6]))
    log = (node.root / "leader.log").read_text()
    assert "offload decision job=" in log and "onboard decision job=" in log


def test_disk_hit_is_promoted_back_to_host(make_node):
    node, client, eng, keys, original = two_blocks_in_g3(make_node)
    eng[:] = 0
    client.wait(client.onboard(keys, [10, 11]))  # a G3 hit: the leader promotes them to G2
    assert np.array_equal(eng[10:12], original)
    assert wait_tiers(client, keys, (Tier.HOST, Tier.HOST)) == (Tier.HOST, Tier.HOST)
    eng[:] = 0
    client.wait(client.onboard(keys, [20, 21]))  # now from G2, bytes still right
    assert np.array_equal(eng[20:22], original)
    assert wait_counter(node, "kvbm_promoted_blocks", 2) and wait_counter(node, "kvbm_onboard_blocks_h2d", 2)
    assert "promotion decision job=" in (node.root / "leader.log").read_text()
