"""Persistent G3 (DYN_KVBM_DISK_PERSIST) on the real vLLM engine: the whole kvbm node is stopped
and started again between two engine runs, and the second engine's first request is served from
the G3 blocks the first engine stored, with the same greedy outputs."""
from __future__ import annotations

import pytest

from conftest import run_engine

pytestmark = pytest.mark.timeout(900)


def test_a_restarted_node_serves_the_g3_blocks_of_the_previous_run(vllm_python, tiny_model, kvbm_node, tmp_path):
    node = kvbm_node(DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="512", DYN_KVBM_DISK_PERSIST="true")  # disk-only
    env = {k: v for k, v in node.env.items() if k != "PYTHONHASHSEED"}
    first = run_engine(vllm_python, tiny_model, tmp_path / "run1.json", "--kvbm", "--rounds", "2", env=env)
    assert node.counters()["kvbm_offload_blocks_d2d"] > 0, "nothing was stored in G3"
    node.stop()  # workers, then the leader: a clean stop keeps the G3 files with persistence on
    node.start("leader")
    node.start("worker")
    second = run_engine(vllm_python, tiny_model, tmp_path / "run2.json", "--kvbm", "--rounds", "2", env=env)
    assert first["records"][0]["cached"] == 0
    assert second["records"][0]["cached"] > 0, "the restarted node served nothing of the first run's G3"
    assert [r["output"] for r in second["records"]] == [r["output"] for r in first["records"]]
    c = node.counters()
    assert c["kvbm_g3_restored_blocks"] > 0 and c["kvbm_onboard_blocks_d2d"] > 0
    assert c["kvbm_corrupt_blocks"] == 0
