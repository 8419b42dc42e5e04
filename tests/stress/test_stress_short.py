"""The short stress run (part of ``make test``): 48 greedy requests, 8 at a time, through the
real vLLM engine (CPU build) with a 24-block G1, prefix caching, 4 shared prefixes, and kvbm
with a 48-block G2 and a G3, compared request by request with vLLM alone.

The longer runs, with faults, are ``python -m tests.stress.run`` (tests/stress/README.md).
"""
from __future__ import annotations

import pytest

from .harness import EngineConfig, baseline_stability, run_baseline, run_pass
from .node import NodeConfig
from .workload import WorkloadSpec, generate

pytestmark = pytest.mark.timeout(1200)

SPEC = WorkloadSpec(users=16, turns=3, groups=4, seed=1)
# fp32 tiny Llama: 24 blocks of 32 tokens; the engine core in-process (a faster start in CI); every
# step's stores planned off the scheduler's thread and shipped with the next step (the default plans
# only steps of 64 blocks or more there; this workload's steps are smaller)
ENGINE = EngineConfig(g1_bytes=3 << 20, max_num_seqs=8, multiprocess=False,
                      kvbm_extra={"async_store_min_blocks": 1})
NODE = NodeConfig(g2_blocks=48, g3_blocks=512)


@pytest.fixture(scope="module")
def stress_work(tmp_path_factory):
    return tmp_path_factory.mktemp("stress")


@pytest.fixture(scope="module")
def stress_baseline(stress_model, stress_work) -> dict:
    return run_baseline(stress_model, generate(SPEC), ENGINE, stress_work)


@pytest.fixture(scope="module")
def stress_pass(stress_model, stress_work, stress_baseline) -> dict:
    return run_pass("short", stress_model, generate(SPEC), stress_baseline, ENGINE, NODE, [], stress_work)


@pytest.mark.stress_long
def test_baseline_does_not_depend_on_batch_composition(stress_model, stress_work, stress_baseline):
    """Other order, a third of the concurrency, 3x G1 (no preemption): the same tokens."""
    out = baseline_stability(stress_model, generate(SPEC), ENGINE, stress_work, stress_baseline)
    assert out["first"]["preemptions"] > 0
    assert out["second"]["preemptions"] < out["first"]["preemptions"]
    assert out["differing"] == []


def test_stress_run_moves_blocks_through_every_tier(stress_pass):
    """The run exercised what it is meant to: preemptions, loads from kvbm, G2 -> G3 demotions,
    hits from G3 and their promotion back to G2."""
    kv = stress_pass["kvbm"]
    assert stress_pass["preemptions"] > 0
    assert stress_pass["external_hit_tokens"] > 0
    assert kv["kvbm_offload_blocks_d2h"] > 0 and kv["kvbm_onboard_blocks_h2d"] > 0
    assert kv["kvbm_offload_blocks_h2d"] > 0, "nothing was demoted to G3"
    assert kv["kvbm_onboard_blocks_d2d"] > 0 and kv["kvbm_promoted_blocks"] > 0, "no hit came from G3"
    assert stress_pass["engine_log"]["loads_failed"] == 0 and stress_pass["engine_log"]["stores_failed"] == 0


def test_stress_outputs_identical_to_vllm_alone(stress_pass):
    assert stress_pass["differing_count"] == 0, stress_pass["differing"]
