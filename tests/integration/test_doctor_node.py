"""`kvbm doctor` beside real daemons (leader + workers as child processes): no node, a ready
node (pool sizes equal to the leader's own plan), a missing worker, a hung leader, failed
loads counted, and the metrics port held by our own leader."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from support.fault_env import fault_env

from kvbm_client import sequence_hashes
from kvbm_client.doctor.machine import meminfo

from conftest import Node


def doctor(node: Node, *args: str, **env: str) -> tuple[int, dict[str, dict]]:
    """Run `kvbm doctor --json` in the node's environment; (exit code, checks by id)."""
    # NOTE: VLLM_CPU_KVCACHE_SPACE=0: no CPU engine here, so /dev/shm's size is not the question.
    full = {**node.env, "VLLM_CPU_KVCACHE_SPACE": "0", **env}
    done = subprocess.run([sys.executable, "-m", "kvbm_client.cli", "doctor", "--json", *args],
                          env=full, capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    assert report["exit_code"] == done.returncode
    return done.returncode, {c["check"]: c for c in report["checks"]}


def wait_until(predicate, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.05)


def test_no_node_is_not_running_and_not_a_failure(make_node) -> None:
    node = make_node(start=False)
    code, checks = doctor(node)
    assert checks["node.leader"]["status"] == "info"
    assert checks["node.leader"]["message"] == f"not running (no leader answers at {node.leader_address})"
    assert all(checks[c]["status"] == "skip" for c in ("node.workers", "node.pools", "node.failures"))
    assert code == 0


def test_ready_node(make_node) -> None:
    node = make_node(num_workers=2, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="", DYN_KVBM_CPU_CACHE_GB="0.001",
                     DYN_KVBM_DISK_CACHE_GB="0.002")
    client, _engines = node.ready_client()  # 2 workers x 4 layers x 2048 B: 16 KiB a block
    keys = sequence_hashes(list(range(4 * 16)), 16)
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    assert client.match(keys).num_matched == 4  # counts a G2 hit
    client.wait(client.onboard(keys, [10, 11, 12, 13]))
    code, checks = doctor(node)
    assert checks["node.leader"]["status"] == "ok" and ": ready, 2 worker(s)" in checks["node.leader"]["message"]
    workers = checks["node.workers"]
    assert workers["status"] == "ok" and workers["data"]["states"] == {"0": "ready", "1": "ready"}
    assert "G3 via " in workers["message"]
    # The doctor's sizing (kvbm_client.sizing) gives the leader's own plan for this layout.
    leader = {t.tier: t.capacity_blocks for t in node.status().tiers}
    pools = checks["config.pools"]
    assert pools["status"] == "ok"
    assert (pools["data"]["host_slots"], pools["data"]["disk_slots"]) == (61, 122) == (leader[2], leader[3])
    assert "the running node's 2 worker(s)" in pools["message"]
    held = checks["node.pools"]
    assert held["status"] == "ok" and held["data"]["G2"]["used"] == 4 and held["data"]["G2"]["hit_rate"] > 0
    assert checks["node.failures"]["status"] == "ok"
    assert checks["config.host_memory"]["message"].startswith("G2 already allocated by the running node")
    assert code == 0


def test_other_config_than_the_running_node_warns(make_node) -> None:
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="", DYN_KVBM_CPU_CACHE_GB="0.001")
    node.ready_client()
    code, checks = doctor(node, "--cpu-cache-gb", "0.002")
    pools = checks["config.pools"]
    assert pools["status"] == "warn" and "the running node has other sizes (G2 122 vs 244)" in pools["message"]
    assert pools["remedy"] == "restart the node (kvbm serve) to apply this configuration"
    assert code == 0


def test_missing_worker_warns(make_node) -> None:
    node = make_node(num_workers=2)
    node.signal_worker("1", signal.SIGKILL)
    wait_until(lambda: len(node.status().workers) == 1)
    code, checks = doctor(node)
    leader = checks["node.leader"]
    assert leader["status"] == "warn" and ": waiting-for-workers, 1 worker(s)" in leader["message"]
    assert leader["remedy"].startswith("start the missing kvbm-worker(s)")
    assert code == 0


def test_hung_leader_fails(make_node) -> None:
    node = make_node()
    os.kill(node.leader.pid, signal.SIGSTOP)
    try:
        code, checks = doctor(node, "--timeout", "0.5")
    finally:
        os.kill(node.leader.pid, signal.SIGCONT)
    leader = checks["node.leader"]
    assert leader["status"] == "fail" and "but does not answer Status (UNAVAILABLE" in leader["message"]
    assert leader["remedy"].startswith("the leader may be hung or stopped")
    assert code == 1


def test_failed_loads_are_counted(make_node) -> None:
    node = make_node(**fault_env(FAIL_LOADS="1"))  # test-only fault: every load fails after writing zeros
    client, _ = node.ready_client()
    keys = sequence_hashes(list(range(2 * 16)), 16)
    client.wait(client.offload(keys, [0, 1]))
    try:
        client.wait(client.onboard(keys, [5, 6]))
    except Exception:
        pass
    wait_until(lambda: node.status().counters["kvbm_failed_jobs"] >= 1)
    code, checks = doctor(node)
    failures = checks["node.failures"]
    assert failures["status"] == "warn" and "kvbm_failed_jobs 1" in failures["message"]
    assert failures["data"]["worker 0 jobs_failed"] >= 1
    assert failures["remedy"].startswith("look at the leader's and workers' logs")
    assert code == 0


def test_metrics_port_held_by_our_leader(make_node, free_port) -> None:
    port = free_port()
    node = make_node(DYN_KVBM_METRICS="true", DYN_KVBM_METRICS_PORT=str(port))
    _code, checks = doctor(node)
    metrics = checks["services.metrics_port"]
    assert metrics["status"] == "ok"
    assert metrics["message"] == f"127.0.0.1:{port} in use by this node's leader (serves kvbm_* metrics)"


def test_killed_leader_is_not_running(make_node) -> None:
    """A leader killed with -9 leaves its socket file behind; nothing accepts on it."""
    node = make_node()
    node.leader.send_signal(signal.SIGKILL)
    node.leader.wait(10)
    assert (node.socket_dir / "leader.sock").exists()
    _code, checks = doctor(node)
    assert checks["node.leader"]["status"] == "info"
    assert checks["node.leader"]["message"].startswith("not running")


def test_failed_pool_allocation_is_explained(make_node) -> None:
    """G2 of 4x the machine's RAM: the worker's pool allocation fails (ENOMEM); doctor names
    both ends. 4 MiB blocks keep the leader's slot table small."""
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "1":
            pytest.skip("vm.overcommit_memory=1 grants any mapping: the worker would be OOM-killed while "
                        "touching G2 instead of failing its allocation")
    g2_gb = 4 * meminfo()["MemTotal"] / 1e9
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="", DYN_KVBM_CPU_CACHE_GB=f"{g2_gb:.0f}")
    node.client().register_region("0", node.engine(num_blocks=4, num_layers=4, page_bytes=1 << 20).spec())
    wait_until(lambda: node.status().workers[0].state == "failed")
    code, checks = doctor(node)
    workers = checks["node.workers"]
    assert workers["status"] == "fail" and workers["message"] == "0: failed"
    assert workers["remedy"].startswith("pool allocation failed: the worker's log says why")
    memory = checks["config.host_memory"]
    assert memory["status"] == "fail" and "G2 does not fit" in memory["message"]
    assert code == 1
