"""Persistent G3 when the disk fails: a full filesystem (a small tmpfs) and EIO while writing. The
block whose write or record failed is not indexed (not matched, not restored), the daemons keep
running and serving what they hold, and a restart restores exactly the blocks that were indexed."""
from __future__ import annotations

import os
import sqlite3

import pytest

from kvbm_client import KvbmError
from kvbm_client.local_node import LocalNode

from support.fault_env import fault_env
from support.mounts import mounted
from support.persist_blocks import counter, keys_of, load_and_check, store, wait_for

PERSIST = dict(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="64",
               DYN_KVBM_DISK_PERSIST="true")


def leader_rows(node) -> int:  # type: ignore[no-untyped-def]
    conn = sqlite3.connect(node.disk_dir / "kvbm-g3-leader.idx")
    try:
        return int(conn.execute("SELECT count(*) FROM blocks").fetchone()[0])
    finally:
        conn.close()


def restart(node, **env: str) -> None:  # type: ignore[no-untyped-def]
    for c in node.clients:
        c.close()
    node.clients.clear()
    LocalNode.stop(node)
    node.env.update(env)
    node.env = {k: v for k, v in node.env.items() if v != ""}
    node.start()


def fill_up(directory) -> int:  # type: ignore[no-untyped-def]
    """Write a file until the filesystem is full; returns its size."""
    chunk, size = b"\0" * 4096, 0
    with open(directory / "filler", "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError:
                return size
            size += len(chunk)


def test_disk_full_the_block_is_not_indexed_and_the_node_keeps_serving(make_node):
    node = make_node(start=False, **PERSIST)
    with mounted(node.disk_dir, "tmpfs", "size=1m"):  # 512 KiB of G3 file, the rest for the indexes
        node.start()
        client, engines = node.ready_client()
        a, b, c = keys_of(8, seed=1), keys_of(8, seed=2), keys_of(8, seed=3)
        store(client, engines, a, range(8))
        wait_for(lambda: leader_rows(node) == 8, what="the leader's index rows of A")
        assert fill_up(node.disk_dir) > 0
        with pytest.raises(KvbmError):
            store(client, engines, b, range(8, 16))  # the data fits (preallocated), its record does not
        assert client.match(b).num_matched == 0
        assert load_and_check(client, engines, a, range(32, 40)) == 8, "the node keeps serving what it holds"
        assert "database or disk is full" in (node.root / "worker-0.log").read_text()
        (node.disk_dir / "filler").unlink()
        store(client, engines, c, range(16, 24))
        wait_for(lambda: leader_rows(node) == 16, what="the leader's index rows of C")
        restart(node)
        client, engines = node.ready_client()
        assert counter(node, "kvbm_g3_restored_blocks") == 16
        assert client.match(b).num_matched == 0
        assert load_and_check(client, engines, a, range(32, 40)) == 8
        assert load_and_check(client, engines, c, range(40, 48)) == 8
        for c_ in node.clients:
            c_.close()
        node.clients.clear()
        LocalNode.stop(node)


def test_eio_while_writing_the_block_is_not_indexed(make_node):
    # Test-only fault: the first G3 operation (A's write) succeeds, every later one fails with EIO.
    node = make_node(**PERSIST, **fault_env(DISK_EIO_AFTER="1"))
    client, engines = node.ready_client()
    a, b = keys_of(8, seed=1), keys_of(8, seed=2)
    store(client, engines, a, range(8))
    with pytest.raises(KvbmError):
        store(client, engines, b, range(8, 16))
    assert client.match(b).num_matched == 0
    assert client.match(a).num_matched == 8
    assert all(d.running for d in node.daemons), "an I/O error must not stop a daemon"
    wait_for(lambda: leader_rows(node) == 8, what="the leader's index rows of A")
    restart(node, KVBM_FAULT_DISK_EIO_AFTER="", PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    client, engines = node.ready_client()
    assert counter(node, "kvbm_g3_restored_blocks") == 8
    assert client.match(b).num_matched == 0
    assert load_and_check(client, engines, a, range(16, 24)) == 8
