"""The connector on the real vLLM engine when something fails: the worker daemon killed
mid-workload, no kvbm at all, loads that write zeros (the negative control) or fail (vLLM
recomputes). Outputs are compared with the baseline run without kvbm (bit for bit).
"""
from __future__ import annotations

import json
import time

import pytest

from conftest import outputs, run_engine
from support.fault_env import fault_env

pytestmark = pytest.mark.timeout(900)


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


def test_engine_serves_without_kvbm_running(vllm_python, tiny_model, baseline, tmp_path):
    """No leader, no worker: the connector warns, retries in the background, and vLLM serves.
    Only the first request may wait for the links' first attempts (each at most the 2 s
    timeout); no later one waits for a retry (before 2026-11-27 each request waited ~4 s: the
    scheduler's and the store planner's links retried on the scheduler's thread)."""
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_KVBM_")}
    env["DYN_KVBM_SOCKET_DIR"] = str(tmp_path / "nothing-listens-here")
    start = time.monotonic()
    result = run_engine(vllm_python, tiny_model, tmp_path / "alone.json", "--kvbm", "--rounds", "4", env=env)
    assert outputs(result) == outputs(baseline)
    assert result["metrics"]["vllm:external_prefix_cache_hits"] == 0
    later = max(r["seconds"] for r in result["records"][1:])
    assert later < 2.0, f"a request waited {later:.2f}s: a connection attempt on the engine's thread"
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


def test_failed_async_loads_are_recomputed_on_an_idle_engine(vllm_python, tiny_model, baseline, kvbm_node, tmp_path):
    """``load_mode: async`` (what ``auto`` picks under vLLM's V2 runner or async scheduling, so the
    GPU default) with loads that fail: one prompt at a time, so each request waits for its load with
    nothing else in the engine, whose core runs its own busy loop in its own process. The connector
    reports the failed blocks with the load's end, vLLM recomputes, and the outputs stay the
    baseline's. A recompute that waited for another request to wake the engine (reported against a
    vLLM fork, local-inference-lab/vllm#191) would hang the run here: the next prompt is only sent
    once this one finished, so the engine run would time out."""
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512", **fault_env(FAIL_LOADS="1"))
    result = run_engine(vllm_python, tiny_model, tmp_path / "fail_async.json", "--kvbm", "--rounds", "4",
                        "--kvbm-extra", json.dumps({"load_mode": "async"}), env=node.env, multiprocess=True)
    assert outputs(result) == outputs(baseline)
    c = node.counters()
    assert c["kvbm_failed_jobs"] > 0, "no load was attempted, so nothing was tested"
    assert c.get("kvbm_onboard_blocks_h2d", 0) == 0
    assert "Recovered from KV load failure" in (tmp_path / "fail_async.log").read_text(), \
        "vLLM did not take the failure path"


@pytest.mark.parametrize("lying", [False, True], ids=["waits", "negative-control"])
def test_layerwise_forward_waits_for_late_layers(vllm_python, tiny_model, baseline, kvbm_node, tmp_path, lying):
    """``load_mode: layerwise`` with a worker whose later layer groups land 0.2 s late: the
    forward of each layer waits for its pages, so the outputs stay the baseline's. Negative
    control: the same worker reporting every page landed before copying them makes the
    forward read pages that are not there yet, and the outputs differ (so the waits above are
    what kept them equal). Cost-aware loads are off: the slow loads would otherwise turn later
    hits into recomputes, and this test is about loads. Four layer groups: the daemon's groups are
    front-loaded (2 groups of the tiny model's 4 layers would be 3 + 1, leaving the control a
    single late layer, too little to change the outputs every time); 4 groups leave at least half
    of the pages late, as 2 equal groups did."""
    faults = dict(GROUP_DELAY_SECS="0.2", **({"LAYERS_EARLY": "1"} if lying else {}))
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512", **fault_env(**faults))
    result = run_engine(vllm_python, tiny_model, tmp_path / "layerwise.json", "--kvbm", "--rounds", "4",
                        "--kvbm-extra", json.dumps({"load_mode": "layerwise", "layer_groups": 4,
                                                      "cost_aware_loads": False}), env=node.env,
                        multiprocess=not lying)
    assert result["metrics"]["vllm:external_prefix_cache_hits"] > 0, "nothing was loaded: nothing was tested"
    if lying:
        assert outputs(result) != outputs(baseline)
        return
    # vLLM's default layout (EngineCore apart from the model runner): the scheduler role's early
    # load starts each job in layer groups and the worker role's TransferLayers joins it
    assert outputs(result) == outputs(baseline)
    c = node.counters()
    assert c.get("kvbm_failed_jobs", 0) == 0 and c["kvbm_onboard_blocks_h2d"] > 0
    assert node.worker_status().counters["jobs_joined"] > 0


def test_staged_layerwise_loads_keep_outputs(vllm_python, tiny_model, baseline, kvbm_node, tmp_path):
    """``load_mode: layerwise`` with a worker that has a staging area (``--stage-mib``) and the
    connector's defaults (``staged_loads`` on): each hit's lookup asks the leader to stage it,
    the worker copies its first layer groups into the area before vLLM allocated the blocks, and
    the early load takes them from there. vLLM's default layout (the scheduler role learns the
    worker's area and region across the process boundary); the outputs stay the baseline's."""
    node = kvbm_node(worker_args=("--stage-mib", "8"), DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512")
    result = run_engine(vllm_python, tiny_model, tmp_path / "staged.json", "--kvbm", "--rounds", "4",
                        "--kvbm-extra", json.dumps({"load_mode": "layerwise", "layer_groups": 4,
                                                      "cost_aware_loads": False}), env=node.env,
                        multiprocess=True)
    assert result["metrics"]["vllm:external_prefix_cache_hits"] > 0, "nothing was loaded: nothing was tested"
    assert outputs(result) == outputs(baseline)
    c = node.worker_status().counters
    assert c["loads_staged"] > 0 and c["staged_loads_used"] > 0, dict(c)
    assert node.counters().get("kvbm_failed_jobs", 0) == 0

