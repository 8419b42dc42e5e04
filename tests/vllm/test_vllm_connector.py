"""The connector on the real vLLM engine (CPU build, eager, greedy, tiny local model).

G1 (``kv_cache_memory_bytes``) is deliberately small, so a user's history is evicted from
the engine between its turns and must come back from kvbm. Outputs are compared with the
baseline run without kvbm (bit for bit), and vLLM's own counters show the external hits.
(Faults: ``test_vllm_faults.py``; a restarted engine: ``test_vllm_restart.py``.)
"""
from __future__ import annotations

import json

import pytest

from conftest import cached, outputs, run_engine

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("load_mode", ["sync", "async"])  # layerwise: test_vllm_faults.py
def test_identical_outputs_and_hits_from_g2(vllm_python, tiny_model, baseline, kvbm_node, tmp_path, load_mode):
    node = kvbm_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="512")
    multiprocess = load_mode == "sync"
    check = ["--check-pool"] if multiprocess else []
    result = run_engine(vllm_python, tiny_model, tmp_path / "g2.json", "--kvbm", "--rounds", "4", *check,
                        "--kvbm-extra", json.dumps({"load_mode": load_mode}), env=node.env, multiprocess=multiprocess)
    assert outputs(result) == outputs(baseline)
    # vLLM bound its block pool: stores pin their blocks, finished requests are freed at once
    assert "stores still read stay pinned" in (tmp_path / "g2.log").read_text()
    if multiprocess:  # the engine core's busy loop steps until kvbm's block holds are all reported settled
        assert result["pool_whole_s"] is not None, "blocks stayed held in vLLM's pool after the last request"
    assert result["metrics"]["vllm:external_prefix_cache_hits"] > 0
    assert cached(result) > cached(baseline), "kvbm served no tokens that G1 had lost"
    c = node.counters()
    assert c["kvbm_offload_blocks_d2h"] > 0 and c["kvbm_onboard_blocks_h2d"] > 0
    assert c["kvbm_onboard_blocks_h2d"] * 32 >= result["metrics"]["vllm:external_prefix_cache_hits"]
    assert c["kvbm_presence_filter_misses"] > 0, "no cold lookup was answered by the presence filter"
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
