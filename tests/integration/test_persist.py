"""Persistent G3 (DYN_KVBM_DISK_PERSIST) with real daemons: a node restarted keeps its G3 blocks,
byte for byte; without the setting nothing survives (Dynamo's behaviour)."""
from __future__ import annotations

import sqlite3

import pytest

from kvbm_client.local_node import LocalNode

from support.persist_blocks import counter, keys_of, load_and_check, store

PERSIST = dict(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="64",
               DYN_KVBM_DISK_PERSIST="true")


def restart(node) -> None:  # type: ignore[no-untyped-def]
    """Stop every daemon cleanly (workers, then the leader) and start them again."""
    for c in node.clients:
        c.close()
    node.clients.clear()
    LocalNode.stop(node)
    node.start()


def test_restart_with_persistence_restores_g3_byte_for_byte(make_node):
    node = make_node(**PERSIST)  # disk-only: every offload goes to G3
    client, engines = node.ready_client()
    keys = keys_of(24)
    store(client, engines, keys[:16], range(16))
    store(client, engines, keys[16:], range(16, 24))
    assert client.match(keys).num_matched == 24
    restart(node)
    client, engines = node.ready_client()
    assert counter(node, "kvbm_g3_restored_blocks") == 24
    assert counter(node, "kvbm_g3_discarded_blocks") == 0
    assert counter(node, "kvbm_g3_index_bytes") > 0
    assert load_and_check(client, engines, keys, range(32, 56)) == 24
    log = (node.root / "leader.log").read_text()
    assert "G3 restored from the persistent index: 24 blocks matchable again, 0 discarded" in log
    files = sorted(p.name for p in node.disk_dir.iterdir())
    assert "kvbm-g3-leader.idx" in files and any(n.startswith("kvbm-g3-w0.") and n.endswith(".data") for n in files)
    assert not any(n.startswith("kvbm-disk-cache-") for n in files)


def test_restart_without_persistence_restores_nothing_and_removes_files(make_node):
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="64")
    client, engines = node.ready_client()
    keys = keys_of(8)
    store(client, engines, keys, range(8))
    assert client.match(keys).num_matched == 8
    for c in node.clients:
        c.close()
    node.clients.clear()
    LocalNode.stop(node)
    assert list(node.disk_dir.iterdir()) == [], "a clean stop leaves no G3 file behind"
    node.start()
    client, engines = node.ready_client()
    assert client.match(keys).num_matched == 0
    assert counter(node, "kvbm_g3_restored_blocks") == 0


def test_evicted_blocks_are_not_restored_and_the_index_follows_evictions(make_node):
    node = make_node(**{**PERSIST, "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "8"})
    client, engines = node.ready_client()
    old, new = keys_of(8, seed=1), keys_of(8, seed=2)
    store(client, engines, old, range(8))
    store(client, engines, new, range(8, 16))  # evicts every old block: their slots are rewritten
    restart(node)
    client, engines = node.ready_client()
    assert client.match(old).num_matched == 0
    assert load_and_check(client, engines, new, range(16, 24)) == 8
    rows = sqlite3.connect(node.disk_dir / "kvbm-g3-leader.idx").execute("SELECT count(*) FROM blocks").fetchone()[0]
    assert rows == 8


def test_g2_and_g3_restart_restores_the_demoted_blocks(make_node):
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="8", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="32",
                     DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER="true", DYN_KVBM_DISK_PERSIST="true")
    client, engines = node.ready_client()
    keys = keys_of(24)
    for i in range(0, 24, 4):  # 24 blocks through an 8-block G2: the older ones are demoted to G3
        store(client, engines, keys[i:i + 4], range(i, i + 4))
    on_disk = [t for t in node.status().tiers if t.tier == 3][0].used_blocks
    assert on_disk >= 16
    restart(node)
    client, engines = node.ready_client()
    assert counter(node, "kvbm_g3_restored_blocks") == on_disk
    assert load_and_check(client, engines, keys[:16], range(32, 48)) == 16


def test_layout_change_discards_the_index_with_one_log_line(make_node):
    node = make_node(**PERSIST)
    client, engines = node.ready_client()  # 4 layers x 2048 bytes
    keys = keys_of(12)
    store(client, engines, keys, range(12))
    old_files = sorted(p.name for p in node.disk_dir.glob("kvbm-g3-w0.*"))
    restart_engine_layout = dict(num_layers=2, page_bytes=4096)  # same bytes per block, another layout
    for c in node.clients:
        c.close()
    node.clients.clear()
    LocalNode.stop(node)
    node.start()
    client, engines = node.ready_client(**restart_engine_layout)
    assert client.match(keys).num_matched == 0
    assert counter(node, "kvbm_g3_restored_blocks") == 0
    assert counter(node, "kvbm_g3_discarded_blocks") == 12
    lines = [line for line in (node.root / "leader.log").read_text().splitlines() if "discarded" in line]
    assert len([line for line in lines if "12 discarded" in line]) == 1
    assert "engine layout changed" in lines[-1]
    assert not set(old_files) & {p.name for p in node.disk_dir.iterdir()}, "the old layout's files are removed"
    # the new layout persists in turn
    store(client, engines, keys, range(12))
    restart(node)
    client, engines = node.ready_client(**restart_engine_layout)
    assert load_and_check(client, engines, keys, range(20, 32)) == 12


@pytest.mark.parametrize("lost", ["idx", "data"])
def test_tp2_block_needs_every_rank_shard(make_node, lost):
    node = make_node(num_workers=2, **PERSIST)
    client, engines = node.ready_client()
    keys = keys_of(10)
    store(client, engines, keys, range(10))
    for c in node.clients:
        c.close()
    node.clients.clear()
    LocalNode.stop(node)
    for path in node.disk_dir.glob(f"kvbm-g3-w1.*.{lost}*"):  # rank 1's index (with its WAL) or its data file
        path.unlink()
    node.start()
    client, engines = node.ready_client()
    assert client.match(keys).num_matched == 0
    assert counter(node, "kvbm_g3_restored_blocks") == 0
    assert counter(node, "kvbm_g3_discarded_blocks") == 10
    assert "worker 1: no record of the slot" in (node.root / "leader.log").read_text()
    store(client, engines, keys, range(10))  # the node keeps working, and rank 0's old shards are rewritten
    assert load_and_check(client, engines, keys, range(20, 30)) == 10
