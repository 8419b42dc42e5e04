"""NATS with real processes: demotion commands acknowledged over NATS, KV events for routers,
a bounded event buffer, and nats-server stopped and restarted."""
from __future__ import annotations

import signal
import time

import numpy as np

from cluster_support import wait_for
from kvbm_client import sequence_hashes


def keys_of(n: int, seed: int):
    return sequence_hashes([seed * 100_003 + i for i in range(n * 16)], 16)


def counters(node) -> dict:
    return dict(node.status().counters)


def test_demotions_over_nats_and_kv_events(nats_server, make_cluster_node, collect_events):
    node = make_cluster_node("a", nats=nats_server, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="8",
                             DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="16", DYN_KVBM_HOST_FREE_WATERMARK="0.5",
                             DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER="true")
    events = collect_events(nats_server.url, "kvbm.v1.events.a")
    client, engines = node.ready_client()
    keys = keys_of(8, 1)
    parents = [b"\x00" * 8] + keys[:-1]
    client.wait(client.offload(keys, list(range(8)), parents))
    # stored: every hash with its parent, once every worker confirmed.
    wait_for(lambda: {k.hex() for k in keys} <= events.stored_hashes(), 5, "stored events")
    blocks = {b["block_hash"]: b["parent_hash"] for m in events.of_kind("stored") for b in m["blocks"]}
    assert blocks[keys[3].hex()] == keys[2].hex()
    # G2 is over its watermark: the leader demotes G2 -> G3 in the background, over NATS.
    wait_for(lambda: counters(node)["kvbm_offload_blocks_h2d"] >= 4, 10, "demotions acknowledged")
    assert counters(node)["kvbm_commands_undelivered"] == 0
    assert "command over NATS: ok" in (node.root / "worker-0.log").read_text()
    engines["0"].array[32:40] = 0
    client.wait(client.onboard(keys, list(range(32, 40))))
    assert np.array_equal(engines["0"].array[32:40], engines["0"].array[0:8])
    # the worker confirms a load to the leader beside its answer: until that lands, the load's
    # blocks stay pinned and a store finds G2 full of them (skipped, nothing evicted)
    wait_for(lambda: all(t.pinned_blocks == 0 for t in node.status().tiers), 5, "the load's pins released")
    # removed: without room anywhere, new blocks evict old ones.
    for seed in range(2, 6):
        client.wait(client.offload(keys_of(8, seed), list(range(8, 16))))
    wait_for(lambda: events.of_kind("removed"), 10, "removed events")
    # cleared: a worker is lost.
    node.signal_worker("0", signal.SIGKILL)
    wait_for(lambda: events.of_kind("cleared"), 5, "cleared event")
    ids = [m["event_id"] for m in events.messages]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert counters(node)["kvbm_kv_events_dropped"] == 0


def test_nats_restart_and_bounded_event_buffer(nats_server, make_cluster_node, collect_events):
    node = make_cluster_node("a", nats=nats_server, DYN_KVBM_EVENT_BUFFER="3")
    events = collect_events(nats_server.url, "kvbm.v1.events.a")
    client, engines = node.ready_client()
    client.wait(client.offload(keys_of(2, 1), [0, 1]))
    wait_for(lambda: len(events.of_kind("stored")) == 1, 5, "first event")
    nats_server.stop(kill=True)
    # The data path does not need NATS; events wait in the bounded buffer, then are dropped.
    start = time.monotonic()
    for seed in range(2, 8):
        client.wait(client.offload(keys_of(2, seed), [2 * seed, 2 * seed + 1]))
    assert time.monotonic() - start < 5, "offloads were slowed down by a dead NATS"
    engines["0"].array[40:42] = 0
    client.wait(client.onboard(keys_of(2, 7), [40, 41]))
    assert np.array_equal(engines["0"].array[40:42], engines["0"].array[14:16])
    dropped = counters(node)["kvbm_kv_events_dropped"]
    assert dropped >= 1
    published = counters(node)["kvbm_kv_events_published"]
    nats_server.start()
    # Reconnected by itself: the 3 buffered events are published, then new ones. (NATS delivers a
    # message to the subscribers connected then, so the buffered ones are counted at the leader,
    # and the new ones go to a subscriber connected after the restart: how this test's first
    # one reconnects is nats-py's business, not the leader's.)
    wait_for(lambda: counters(node)["kvbm_kv_events_published"] >= published + 3, 15,
             "buffered events published after restart")
    after_restart = collect_events(nats_server.url, "kvbm.v1.events.a")
    client.wait(client.offload(keys_of(2, 9), [50, 51]))
    wait_for(lambda: keys_of(2, 9)[0].hex() in after_restart.stored_hashes(), 5, "new events after restart")
    last_id = max(m["event_id"] for m in events.messages + after_restart.messages)
    # Every id is either published or counted as dropped: the gaps tell a router what it missed.
    after = counters(node)
    assert after["kvbm_kv_events_published"] == published + 3 + 1
    assert after["kvbm_kv_events_published"] + after["kvbm_kv_events_dropped"] == last_id
