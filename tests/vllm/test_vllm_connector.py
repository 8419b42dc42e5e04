"""The connector on the real vLLM engine (CPU build, eager, greedy, tiny local model).

G1 (``kv_cache_memory_bytes``) is deliberately small, so a user's history is evicted from
the engine between its turns and must come back from kvbm. Outputs are compared with the
baseline run without kvbm (bit for bit), and vLLM's own counters show the external hits.
"""
from __future__ import annotations

import json
import time

import pytest

from conftest import run_engine
from support.fault_env import fault_env

pytestmark = pytest.mark.timeout(900)


def outputs(result: dict) -> list[list[int]]:
    return [r["output"] for r in result["records"]]


def cached(result: dict) -> int:
    return sum(r["cached"] for r in result["records"])


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_identical_outputs_and_hits_from_g2(vllm_python, tiny_model, baseline, kvbm_node, tmp_path, load_mode):
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512")
    result = run_engine(vllm_python, tiny_model, tmp_path / "g2.json", "--kvbm", "--rounds", "4",
                        "--kvbm-extra", json.dumps({"load_mode": load_mode}), env=node.env,
                        multiprocess=load_mode == "sync")
    assert outputs(result) == outputs(baseline)
    assert result["metrics"]["vllm:external_prefix_cache_hits"] > 0
    assert cached(result) > cached(baseline), "kvbm served no tokens that G1 had lost"
    c = node.counters()
    assert c["kvbm_offload_blocks_d2h"] > 0 and c["kvbm_onboard_blocks_h2d"] > 0
    assert c["kvbm_onboard_blocks_h2d"] * 32 >= result["metrics"]["vllm:external_prefix_cache_hits"]
    w = node.worker_status()
    # Loads were started early by the scheduler role and joined by the worker role, and each
    # was copied once: bytes per block loaded (worker) equal bytes per block stored.
    assert w.counters["jobs_joined"] > 0
    assert w.counters["bytes_loaded"] * c["kvbm_offload_blocks_d2h"] == \
        w.counters["bytes_stored"] * c["kvbm_onboard_blocks_h2d"]


def test_identical_outputs_through_g3(vllm_python, tiny_model, baseline, kvbm_node, tmp_path):
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="12", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="512")
    result = run_engine(vllm_python, tiny_model, tmp_path / "g3.json", "--kvbm", "--rounds", "4", env=node.env)
    assert outputs(result) == outputs(baseline)
    c = node.counters()
    assert c["kvbm_offload_blocks_h2d"] > 0, "nothing went G2 -> G3"
    assert c["kvbm_onboard_blocks_d2d"] > 0, "nothing came back from G3"
    assert result["metrics"]["vllm:external_prefix_cache_hits"] > 0


def test_tenants_with_different_cache_salt_never_share(vllm_python, tiny_model, kvbm_node, tmp_path):
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512")
    result = run_engine(vllm_python, tiny_model, tmp_path / "salt.json", "--kvbm", "--rounds", "1",
                        "--same-first-turn", "--salts", "tenant-a,tenant-b", env=node.env)
    first = {r["user"]: r for r in result["records"] if r["round"] == 0}
    # Users 0 and 2 are tenant A, 1 and 3 tenant B, all with the same tokens.
    assert first[0]["cached"] == 0
    assert first[1]["cached"] == 0, "tenant B was served tenant A's blocks"
    assert first[2]["cached"] > 0 and first[3]["cached"] > 0, "a tenant missed its own blocks"


def _wait_file(path, proc, timeout=300) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the engine died"
        assert time.monotonic() < end, f"timed out waiting for {path.name}"
        time.sleep(0.1)


def test_worker_killed_mid_workload(vllm_python, tiny_model, baseline, kvbm_node, tmp_path):
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512")
    pause = tmp_path / "pause"
    pause.mkdir()
    out = tmp_path / "kill.json"
    proc = run_engine(vllm_python, tiny_model, out, "--kvbm", "--rounds", "4", "--pause-after-rounds", "0,1",
                      "--pause-dir", str(pause), env=node.env, wait=False)
    _wait_file(pause / "paused-0", proc)
    node.kill("worker")  # SIGKILL: its pools and every block go with it
    (pause / "resume-0").touch()
    _wait_file(pause / "paused-1", proc)  # round 1 ran without a worker
    before = node.counters()
    node.start("worker")  # as `kvbm serve` would restart it
    node.wait_ready(60)  # the idle engine's connector re-registers its KV cache by itself
    (pause / "resume-1").touch()
    assert proc.wait(400) == 0, out.with_suffix(".log").read_text()[-3000:]
    import json
    result = json.loads(out.read_text())
    assert outputs(result) == outputs(baseline)
    after = node.counters()
    assert after["kvbm_offload_blocks_d2h"] > before["kvbm_offload_blocks_d2h"], "no offload after the restart"
    assert after["kvbm_onboard_blocks_h2d"] > before["kvbm_onboard_blocks_h2d"], "no hits after the restart"
    assert after["kvbm_lost_blocks"] > 0


def test_engine_restart_hits_old_prefixes(vllm_python, tiny_model, kvbm_node, tmp_path):
    """kvbm's block identity is the same in every process: a restarted engine hits the blocks
    the first one stored although vLLM's own block hashes differ between the two processes
    (``xxhash`` without PYTHONHASHSEED seeds them at random per process, as vLLM 0.26 does)."""
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512")
    env = {k: v for k, v in node.env.items() if k != "PYTHONHASHSEED"}
    runs = []
    for name in ("run1", "run2"):
        runs.append(run_engine(vllm_python, tiny_model, tmp_path / f"{name}.json", "--kvbm", "--rounds", "2",
                               "--hash-algo", "xxhash", env=env))
        assert runs[-1]["pythonhashseed"] is None, "PYTHONHASHSEED reached the engine"
        log = (tmp_path / f"{name}.log").read_text()
        assert "random per-process NONE_HASH seed" in log, "vLLM's own block hashes were reproducible: proves nothing"
    first, second = runs
    assert first["records"][0]["cached"] == 0
    assert second["records"][0]["cached"] > 0, "the restarted engine got no hit on the old prefixes"
    assert second["metrics"]["vllm:external_prefix_cache_hits"] > first["metrics"]["vllm:external_prefix_cache_hits"]
    assert outputs(second) == outputs(first)


def test_engine_serves_without_kvbm_running(vllm_python, tiny_model, baseline, tmp_path):
    """No leader, no worker: the connector warns, retries in the background, and vLLM serves."""
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_KVBM_")}
    env["DYN_KVBM_SOCKET_DIR"] = str(tmp_path / "nothing-listens-here")
    start = time.monotonic()
    result = run_engine(vllm_python, tiny_model, tmp_path / "alone.json", "--kvbm", "--rounds", "4", env=env)
    assert outputs(result) == outputs(baseline)
    assert result["metrics"]["vllm:external_prefix_cache_hits"] == 0
    assert time.monotonic() - start < 300


def test_negative_control_corrupted_loads_change_outputs(vllm_python, tiny_model, baseline, kvbm_node, tmp_path):
    """The comparison can fail: a worker that zeroes what it loads makes the outputs differ, so
    identical outputs above mean the engine's forward pass read the bytes kvbm delivered."""
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512", **fault_env(CORRUPT_LOADS="1"))
    result = run_engine(vllm_python, tiny_model, tmp_path / "corrupt.json", "--kvbm", "--rounds", "4", env=node.env)
    assert result["metrics"]["vllm:external_prefix_cache_hits"] > 0
    assert outputs(result) != outputs(baseline)


def test_failed_sync_loads_are_recomputed(vllm_python, tiny_model, baseline, kvbm_node, tmp_path):
    """A synchronous load that fails after the engine counted its tokens as computed (the worker
    writes zeros, then errors) is recomputed by vLLM: the outputs stay the baseline's."""
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512", **fault_env(FAIL_LOADS="1"))
    result = run_engine(vllm_python, tiny_model, tmp_path / "fail.json", "--kvbm", "--rounds", "4",
                        "--kvbm-extra", json.dumps({"load_mode": "sync"}), env=node.env)
    assert outputs(result) == outputs(baseline)
    c = node.counters()
    assert c["kvbm_failed_jobs"] > 0, "no load was attempted, so nothing was tested"
    assert c.get("kvbm_onboard_blocks_h2d", 0) == 0
