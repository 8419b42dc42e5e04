"""etcd registration and discovery with real processes: leaders and workers register under
/kvbm/v1/nodes/, the init barrier works across independently started processes, clients find
their leader through etcd, two nodes see each other, and etcd restarts are survived."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from cluster_support import run_async, wait_for
from kvbm_client import sequence_hashes
from kvbm_client.discovery import PrefixWatch, list_nodes

HERE = Path(__file__).parent


def nodes(etcd) -> dict:
    return run_async(list_nodes(etcd.endpoints), 5)


def client_proc(node, *args: str, timeout: float = 60) -> dict:
    env = {k: v for k, v in node.env.items() if k != "DYN_KVBM_LEADER_ADDRESS"}
    out = subprocess.run([sys.executable, str(HERE / "client_proc.py"), *args], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_leader_and_workers_register_with_leases(etcd, make_cluster_node):
    node = make_cluster_node("a", num_workers=2, etcd=etcd)
    wait_for(lambda: set(nodes(etcd).get("a").workers) == {"0", "1"}, 10, "workers registered")
    info = nodes(etcd)["a"]
    assert info.leader["endpoint"] == node.leader_address and info.leader["pid"] == node.leader.pid
    assert info.workers["1"]["endpoint"].endswith("worker-1.sock")
    # kill -9 a worker: its key goes with its lease (TTL 3 s), the leader's stays.
    node.signal_worker("1", signal.SIGKILL)
    took = wait_for(lambda: "1" not in nodes(etcd)["a"].workers, 8, "dead worker's key expired")
    assert took <= 3 + 1.5
    # A clean stop revokes the lease: the leader's key is gone at once.
    node.leader.send_signal(signal.SIGTERM)
    assert node.leader.wait(10) == 0
    assert "a" not in nodes(etcd) or nodes(etcd)["a"].leader is None


def test_independent_start_barrier_and_client_discovery_through_etcd(etcd, make_cluster_node, tmp_path):
    # systemd-style: workers first, the leader later on an address only etcd knows.
    node = make_cluster_node("a", num_workers=2, start=False, etcd=etcd,
                             DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS="20")
    for w in ("0", "1"):
        node.start_worker(w)
    time.sleep(1.0)
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    node.start_leader("--listen", f"unix:{hidden / 'leader.sock'}")
    wait_for(lambda: nodes(etcd).get("a") and nodes(etcd)["a"].leader and
             set(nodes(etcd)["a"].leader["workers"]) == {"0", "1"}, 20, "workers attached via etcd discovery")
    # Two client processes find the leader through etcd; bytes offloaded by one are onboarded
    # by the other.
    first = client_proc(node, "offload", "7", "6", "2")
    assert first["leader_address"] == f"unix:{hidden / 'leader.sock'}" and first["stored"] == 6
    second = client_proc(node, "onboard", "7", "6", "2")
    assert second["matched"] == 6 and second["loaded"] == 6 and second["wrong_bytes"] == 0


def test_barrier_times_out_naming_the_missing_worker_with_etcd(etcd, make_cluster_node):
    node = make_cluster_node("a", num_workers=2, start=False, etcd=etcd,
                             DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS="1.5")
    node.start_worker("0")
    node.start_leader()
    assert node.leader.wait(15) == 3
    assert "workers 1 did not attach" in (node.root / "leader.log").read_text()


def test_two_nodes_see_each_other_through_etcd(etcd, make_cluster_node):
    make_cluster_node("a", num_workers=2, etcd=etcd)
    make_cluster_node("b", num_workers=1, etcd=etcd)
    wait_for(lambda: {"a", "b"} <= set(nodes(etcd)), 10, "both nodes registered")
    seen = nodes(etcd)
    assert seen["a"].leader["leader_id"] != seen["b"].leader["leader_id"]
    assert set(seen["a"].workers) == {"0", "1"} and set(seen["b"].workers) == {"0"}


async def _watch_until(watch: PrefixWatch, stream, predicate, timeout: float):
    end = time.monotonic() + timeout
    import asyncio
    while time.monotonic() < end:
        try:
            kind, key, value = await asyncio.wait_for(stream.__anext__(), max(0.01, end - time.monotonic()))
        except asyncio.TimeoutError:
            break
        if predicate(kind, key, value):
            return kind, key, value
    raise AssertionError("watch did not see the expected change")


def test_etcd_restart_data_path_unaffected_watch_recreated_keys_restored(etcd, make_cluster_node):
    node = make_cluster_node("a", num_workers=1, etcd=etcd)
    client, engines = node.ready_client()
    keys = sequence_hashes(list(range(4 * 16)), 16)

    async def scenario() -> dict:
        watch = PrefixWatch(etcd.endpoints)
        stream = watch.events()
        await _watch_until(watch, stream, lambda k, key, v: key.endswith("/a/workers/0"), 5)  # snapshot
        node.start_worker("8")  # a change seen through the live watch stream
        await _watch_until(watch, stream, lambda k, key, v: k == "put" and key.endswith("/a/workers/8"), 10)
        etcd.stop(kill=True)
        # The data path never touches etcd: offload and onboard keep working while it is down.
        client.wait(client.offload(keys, [0, 1, 2, 3]))
        client.wait(client.onboard(keys, [8, 9, 10, 11]))
        assert np.array_equal(engines["0"].array[8:12], engines["0"].array[0:4])
        time.sleep(1.0)
        etcd.start()  # same data dir
        # A new worker registers after the restart: the re-created watch sees it.
        node.start_worker("9")
        await _watch_until(watch, stream, lambda k, key, v: k == "put" and key.endswith("/a/workers/9"), 15)
        assert watch.recreated >= 1
        # etcd comes back with no data at all: leases are re-granted and keys put again. The
        # re-put keys may carry the values the watch holds (no change to report), so a key that
        # is new after the wipe shows that the watch follows the new etcd: with a watch resumed
        # from the old revision its put could be skipped.
        etcd.stop(kill=True)
        etcd.wipe()
        etcd.start()
        end = time.monotonic() + 15
        while not ((seen := await list_nodes(etcd.endpoints)).get("a") and seen["a"].leader is not None):
            assert time.monotonic() < end, "the leader did not re-register after the wipe"
            await asyncio.sleep(0.1)
        node.start_worker("10")
        await _watch_until(watch, stream, lambda k, key, v: k == "put" and key.endswith("/a/workers/10"), 15)
        await stream.aclose()
        return {}

    run_async(scenario(), 60)
    wait_for(lambda: "0" in nodes(etcd).get("a").workers, 10, "worker 0 re-registered")
    assert "re-registered" in (node.root / "leader.log").read_text()


def test_a_watch_after_etcd_lost_its_data_reports_the_new_state(etcd):
    """etcd wiped and refilled past the watch's old revision before the watch reconnects: the
    watch re-reads the prefix (old keys deleted, the new one put) instead of resuming from its
    old revision, which would skip the new key's put and keep the lost keys in its view."""
    from kvbm_client.discovery import _client
    prefix = "/kvbm-test-wipe/"

    async def scenario() -> None:
        async def put_all(items: list[tuple[str, str]]) -> None:
            client = _client(etcd.endpoints)
            await client.connect()
            try:
                for key, value in items:
                    await client.put(key.encode(), json.dumps(value).encode())
            finally:
                await client.close()

        await put_all([(f"{prefix}old{i}", str(i)) for i in range(10)])
        watch = PrefixWatch(etcd.endpoints, prefix)
        stream = watch.events()
        await _watch_until(watch, stream, lambda k, key, v: key.endswith("old9"), 10)  # the snapshot
        await put_all([(f"{prefix}old10", "10")])
        await _watch_until(watch, stream, lambda k, key, v: key.endswith("old10"), 10)  # now following
        old_revision = watch.revision
        assert old_revision >= 11
        etcd.stop(kill=True)
        etcd.wipe()
        etcd.start()
        # The generator runs only when iterated: all of this happens before it reconnects.
        await put_all([(f"{prefix}new", "n")] + [(f"/kvbm-test-filler/{i}", "f") for i in range(old_revision + 5)])
        await _watch_until(watch, stream, lambda k, key, v: k == "put" and key.endswith("/new"), 15)
        assert set(watch.known) == {f"{prefix}new"}, "keys etcd lost are still in the view"
        assert watch.recreated >= 1
        await stream.aclose()

    run_async(scenario(), 60)
