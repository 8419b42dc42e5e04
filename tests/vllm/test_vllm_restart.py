"""A restarted vLLM engine hits the blocks the first one stored (kvbm's block identity is the
same in every process, with ``PYTHONHASHSEED`` unset)."""
from __future__ import annotations


import pytest

from conftest import outputs, run_engine

pytestmark = pytest.mark.timeout(900)


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
