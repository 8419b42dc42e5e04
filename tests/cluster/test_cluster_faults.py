"""Faults with real processes, in the cluster mode (etcd + NATS): leader kill -9 and restart,
worker kill -9 with two ranks, a worker slower than its deadline. After each, clients get
hits again without manual steps and no onboard returns wrong bytes."""
from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from cluster_support import run_async, wait_for
from kvbm_client import KvbmError, KvbmRequestError, sequence_hashes
from kvbm_client.discovery import list_nodes


def keys_of(n: int, seed: int):
    return sequence_hashes([seed * 100_003 + i for i in range(n * 16)], 16)


def attached(node) -> int:
    try:
        return len(node.status().workers)
    except Exception:  # the new leader is not listening yet
        return -1


def test_leader_kill_9_restart_rejects_old_plans_and_recovers(etcd, nats_server, make_cluster_node):
    node = make_cluster_node("a", num_workers=2, etcd=etcd, nats=nats_server)
    client, engines = node.ready_client()
    keys = keys_of(4, 1)
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    assert client.match(keys).num_matched == 4
    old_leader_id = run_async(list_nodes(etcd.endpoints))["a"].leader["leader_id"]
    stale = client.prepare_load(keys)  # signed by the leader about to die
    node.leader.send_signal(signal.SIGKILL)
    node.leader.wait(5)
    node.start_leader()
    took = wait_for(lambda: attached(node) == 2, 15, "workers re-attached to the new leader")
    assert took < 10
    before = [e.array.copy() for e in engines.values()]
    # (the client's session may have been re-opened meanwhile, before the workers re-attached:
    # it then knows no worker until its next keepalive; ask now)
    client.refresh_workers()
    # The old plan is refused by every worker (new secret); nothing moved.
    with pytest.raises(KvbmRequestError, match="not signed by this node's leader"):
        client.start(stale, [10, 11, 12, 13])
        client.wait(stale)
    assert all(np.array_equal(b, e.array) for b, e in zip(before, engines.values()))
    # The client's session is re-opened by itself; the new leader knows no block: no stale hit.
    assert client.match(keys).num_matched == 0
    client.wait_ready(20)
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    client.wait(client.onboard(keys, [20, 21, 22, 23]))
    for e in engines.values():
        assert np.array_equal(e.array[20:24], e.array[0:4])
    new = run_async(list_nodes(etcd.endpoints))["a"].leader
    assert new["leader_id"] != old_leader_id and new["pid"] == node.leader.pid


def test_worker_kill_9_of_one_rank_unmatches_the_logical_blocks(etcd, nats_server, make_cluster_node):
    node = make_cluster_node("a", num_workers=2, etcd=etcd, nats=nats_server)
    client, engines = node.ready_client()
    keys = keys_of(4, 2)
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    node.signal_worker("1", signal.SIGKILL)
    wait_for(lambda: client.match(keys).num_matched == 0, 5, "blocks missing rank 1 unmatchable")
    node.start_worker("1")
    node.wait_attached()
    client.register_region("1", engines["1"].spec())  # the engine re-registers with the restarted worker
    client.wait_ready(20)
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    client.wait(client.onboard(keys, [30, 31, 32, 33]))
    for e in engines.values():
        assert np.array_equal(e.array[30:34], e.array[0:4])


def test_slow_worker_past_its_deadline(etcd, nats_server, make_cluster_node):
    node = make_cluster_node("a", num_workers=2, etcd=etcd, nats=nats_server, DYN_KVBM_JOB_TIMEOUT_SECS="1.5")
    client, engines = node.ready_client()
    keys = keys_of(4, 3)
    node.workers["1"].send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        handle = client.offload(keys, [0, 1, 2, 3])
        time.sleep(3.5)  # past deadline (1.5 s) + grace (1.5 s): the leader rolled the job back
        node.workers["1"].send_signal(signal.SIGCONT)
        with pytest.raises(KvbmError):
            client.wait(handle)  # the late worker refuses the job (past its deadline)
        assert time.monotonic() - start < 1.5 * 2 + 5 + 3.5, "the client waited past its timeouts"
    finally:
        node.workers["1"].send_signal(signal.SIGCONT)
    assert client.match(keys).num_matched == 0, "a half-written block became matchable"
    assert "past its deadline" in (node.root / "worker-1.log").read_text() or \
        node.status().counters["kvbm_failed_jobs"] >= 1
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    client.wait(client.onboard(keys, [40, 41, 42, 43]))
    for e in engines.values():
        assert np.array_equal(e.array[40:44], e.array[0:4])
