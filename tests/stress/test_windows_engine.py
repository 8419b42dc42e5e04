"""Windows where kvbm could hand wrong KV to the engine (issue 17), through the real vLLM
engine (CPU build): the engine's own use of the blocks, not a stand-in. Slow (two engine
runs each, and a copy that stalls for longer than the connector's old fixed 30 s wait):
marked ``stress_long``, run by ``make stress``. The daemon-level tests of the same windows,
in ``make test``, are in ``test_windows_daemons.py``.

Each test serves a small workload with and without kvbm, with one fault of the test suite's
fault wrapper (``tests/support/faults``) in the worker, and compares every output.
"""
from __future__ import annotations

import numpy as np
import pytest

from .faults import Fault, FaultKind
from .harness import EngineConfig, Run, differing, run_baseline, run_pass
from .node import NodeConfig
from .workload import Request, Wave, Workload

pytestmark = [pytest.mark.stress_long, pytest.mark.timeout(900)]


# ---------------------------------------------------------------------------- windows 2 and 3
def _prompt(seed: int, n: int) -> list[int]:
    rnd = np.random.default_rng(seed)
    return [int(x) for x in rnd.integers(10, 1000, n)]


def _a_and_again(again_max_tokens: int) -> tuple[Request, Request]:
    """Request A (5 full blocks) and a later one sharing those 5 blocks."""
    a = _prompt(1, 5 * 32 + 10)
    return Request("A", a, 4), Request("A-again", a[:5 * 32] + _prompt(2, 40), again_max_tokens)


def _engine_window(stress_model, stress_node, tmp_path, workload: Workload, fault: tuple[str, str],
                   job_timeout_s: float = 40.0) -> dict:
    """Serve ``workload`` through kvbm with one worker fault (``(NAME, value)`` of
    ``KVBM_FAULT_<NAME>``); compare with vLLM alone."""
    engine = EngineConfig(g1_bytes=3 << 20, max_num_seqs=8, max_model_len=640)
    baseline = run_baseline(stress_model, workload, engine, tmp_path / "baseline")
    node = stress_node(NodeConfig(g2_blocks=256, g3_blocks=0, job_timeout_s=job_timeout_s, faults=(fault,)))
    run = Run(stress_model, workload.write(tmp_path / "workload.json"), tmp_path / "kvbm.json", engine, kvbm=True,
              env={"DYN_KVBM_SOCKET_DIR": node.env["DYN_KVBM_SOCKET_DIR"]}, timeout_s=600)
    result = run.finish(run.start())
    assert node.injected_faults(), "the fault was not injected: the window was not opened"
    return {"differing": differing(baseline, result), "result": result, "node": node}


def test_store_copy_outliving_the_connector_wait_is_never_served(stress_model, stress_node, tmp_path):
    """Request A's first store sleeps 36 s on the worker's store lane, inside its 40 s job
    timeout. Before the fix the connector waited a fixed 30 s, A's blocks went to other
    requests, and the copy stored their KV under A's keys; a later request with A's prefix
    loaded it. Now the connector waits until the plan's deadline (+ margin)."""
    others = [Request(f"B{i}", _prompt(100 + i, 170), 24) for i in range(12)]
    a, again = _a_and_again(again_max_tokens=8)
    workload = Workload([a, again, *others], [Wave(["A"]), Wave([r.id for r in others]), Wave(["A-again"])])
    out = _engine_window(stress_model, stress_node, tmp_path, workload, ("STALL", "store:1:36"))
    assert out["differing"] == []


def test_load_copy_outliving_the_connector_wait_never_lands(stress_model, stress_node, tmp_path):
    """A's prefix comes back from kvbm, but the copy sleeps 36 s on the load lane (40 s job
    timeout). Before the fix the connector waited 30 s, reported a load error (vLLM
    recomputed), A finished, its blocks went to C requests, and then the copy wrote A's bytes
    into them (3 of the 12 C requests differed). Now the connector waits for the copy."""
    evict = [Request(f"E{i}", _prompt(200 + i, 170), 8) for i in range(6)]
    victims = [Request(f"C{i}", _prompt(300 + i, 64), 120) for i in range(12)]
    a, again = _a_and_again(again_max_tokens=4)
    workload = Workload([a, again, *evict, *victims], [Wave(["A"]), Wave([r.id for r in evict]),
                                                       Wave(["A-again"] + [r.id for r in victims])])
    out = _engine_window(stress_model, stress_node, tmp_path, workload, ("STALL", "load:1:36"))
    assert out["differing"] == []


# ---------------------------------------------------------------------------- window 7
def test_blocks_computed_over_a_failed_load_are_never_stored(stress_model, stress_node, tmp_path):
    """A2's prefix (6 blocks) comes from kvbm but the load fails; the same step computes A2's
    blocks 6..8 over the unloaded ones and stores them. A3 shares A2's 9 blocks and loads them."""
    a = _prompt(1, 6 * 32 + 10)
    a2 = a[:6 * 32] + _prompt(3, 3 * 32) + _prompt(4, 10)
    a3 = a2[:9 * 32] + _prompt(5, 20)
    evict = [Request(f"E{i}", _prompt(200 + i, 170), 8) for i in range(12)]
    requests = [Request("A", a, 4), Request("A2", a2, 4), Request("A3", a3, 8), *evict]
    workload = Workload(requests, [Wave(["A"]), Wave([f"E{i}" for i in range(6)]), Wave(["A2"]),
                                   Wave([f"E{i}" for i in range(6, 12)]), Wave(["A3"])])
    out = _engine_window(stress_model, stress_node, tmp_path, workload, ("FAIL", "load:1"), job_timeout_s=30.0)
    assert out["result"]["engine_log"]["loads_failed"] >= 1, "A2's load did not fail"
    assert out["result"]["records"]["A3"]["cached"] >= 6 * 32, "A3's prefix did not come back from kvbm"
    assert out["differing"] == []


# ---------------------------------------------------------------------------- a worker killed mid-load
def test_worker_killed_mid_layerwise_load_is_recomputed(stress_model, tmp_path):
    """A-again's prefix comes back from kvbm in layer groups (``load_mode: layerwise``); the
    worker holds back every group after the first for 3 s and is killed with kill -9 0.1 s into
    the first one it holds. The forward has run the first layers over landed pages and waits for
    the rest, which never land: the load fails, vLLM recomputes it, and every output equals vLLM
    alone's (issue 13: "kill -9 the worker during a long load"). The CPU build runs the V1 model
    runner one step at a time, where vLLM recomputes a failed same-step load correctly; the GPU
    run of the same pass: ``python -m tests.stress.run --passes kill-mid-load``."""
    evict = [Request(f"E{i}", _prompt(200 + i, 170), 8) for i in range(6)]
    a, again = _a_and_again(again_max_tokens=8)
    workload = Workload([a, again, *evict], [Wave(["A"]), Wave([r.id for r in evict]), Wave(["A-again"])])
    engine = EngineConfig(g1_bytes=3 << 20, max_num_seqs=8, max_model_len=640, load_mode="layerwise")
    baseline = run_baseline(stress_model, workload, engine, tmp_path / "baseline")
    fault = Fault(FaultKind.KILL_MID_LOAD, delay_s=0.1, duration_s=1.0, spec="3")
    out = run_pass("kill-mid-load", stress_model, workload, baseline, engine,
                   NodeConfig(g2_blocks=256, g3_blocks=0, job_timeout_s=10.0), [fault], tmp_path / "kvbm")
    assert out["fault_errors"] == []
    assert [e["what"] for e in out["fault_events"]][:1] == ["worker kill -9 while a load held back a layer group"]
    assert out["engine_log"]["loads_failed"] >= 1, "the kill hit no load"
    assert out["differing"] == []
