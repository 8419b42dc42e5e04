"""The stress harness: serve one workload with and without kvbm, compare every output.

Runs in the kvbm venv. The engine runs in the vLLM venv (``engine.py``, a child process);
the kvbm node runs as child processes (``node.py``); faults strike from a thread
(``faults.py``). A *pass* is one engine run through kvbm with a fresh node and at most one
kind of fault; its result says how many outputs differ from the baseline (must be 0),
what moved where, and how long the slowest request took (the engine must never hang).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .faults import Fault, FaultInjector
from .node import REPO, NodeConfig, StressNode
from .workload import Workload

ENGINE = Path(__file__).with_name("engine.py")
MODEL_BUILDER = REPO / "tests" / "vllm_support" / "make_tiny_model.py"

#: the leader's counters that show blocks moving through the tiers
TIER_COUNTERS = ("kvbm_offload_blocks_d2h", "kvbm_offload_blocks_h2d", "kvbm_onboard_blocks_h2d",
                 "kvbm_onboard_blocks_d2d", "kvbm_promoted_blocks", "kvbm_evicted_blocks",
                 "kvbm_offload_skipped_present", "kvbm_offload_skipped_full", "kvbm_failed_jobs",
                 "kvbm_lost_blocks", "kvbm_matched_tokens")
#: lines of the engine's log that count the connector's fallbacks
ENGINE_LOG_COUNTS = {"loads_failed": "the engine recomputes it", "stores_failed": "kvbm store of",
                     "stores_dropped": "store plans are dropped", "worker_killed": "killing it, so that no late copy",
                     "worker_exited_mid_load": "exited with a load in flight",
                     "vllm_recovered_load_failures": "Recovered from KV load failure",
                     "worker_lost": "will re-register", "leader_unreachable": "serving without kvbm hits"}


class EngineFailed(RuntimeError):
    """The engine exited with an error or ran past its time limit."""


def vllm_python() -> Path:
    venv = Path(os.environ.get("KVBM_VLLM_VENV", REPO / ".venv-vllm"))
    return venv / "bin" / "python"


def ensure_model(directory: Path) -> Path:
    """The tiny local Llama (``tests/vllm_support/make_tiny_model.py``; reused when built)."""
    subprocess.run([str(vllm_python()), str(MODEL_BUILDER), str(directory)], check=True, capture_output=True)
    return directory


@dataclass(frozen=True)
class EngineConfig:
    """How vLLM serves: the same for the baseline and the kvbm passes (but ``kvbm``)."""

    g1_bytes: int = 3 << 20
    max_num_seqs: int = 8
    max_model_len: int = 640
    block_size: int = 32
    dtype: str = "float32"
    async_scheduling: str = "auto"  # "on" on the GPU build (0.26); the CPU build forces it off
    cuda_graphs: bool = False
    load_mode: str = "auto"
    early_loads: bool = True
    #: vLLM's model runner: "default" (vLLM picks: V2 for most GPU models, V1 on the CPU build
    #: without Triton), "v1" or "v2" (``VLLM_USE_V2_MODEL_RUNNER``)
    model_runner: str = "default"
    #: vLLM's default layout (engine core in its own process); False runs it in-process
    #: (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the same scheduler and connector roles, a faster
    #: start; the CI short test uses it, the harness's command line keeps the default)
    multiprocess: bool = True
    #: more of kvbm's kv_connector_extra_config (e.g. ``gpu_layer_waits``)
    kvbm_extra: dict = field(default_factory=dict)

    def argv(self, kvbm: bool) -> list[str]:
        argv = ["--g1-bytes", str(self.g1_bytes), "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len), "--block-size", str(self.block_size),
                "--dtype", self.dtype, "--async-scheduling", self.async_scheduling]
        if self.cuda_graphs:
            argv.append("--cuda-graphs")
        if kvbm:
            extra = {**self.kvbm_extra, "load_mode": self.load_mode, "early_loads": self.early_loads}
            argv += ["--kvbm", "--kvbm-extra", json.dumps(extra)]
        return argv


@dataclass
class Run:
    """One engine run's inputs and where its files go."""

    model: Path
    workload: Path
    out: Path
    engine: EngineConfig
    kvbm: bool = False
    env: dict = field(default_factory=dict)
    timeout_s: float = 600.0
    src: str = os.environ.get("KVBM_STRESS_SRC", "")  # the checkout whose connector the engine imports

    @property
    def marker_dir(self) -> Path:
        return self.out.with_suffix(".markers")

    @property
    def log(self) -> Path:
        return self.out.with_suffix(".log")

    def start(self) -> subprocess.Popen:
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_KVBM_")}
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [self.src or str(REPO), os.environ.get("PYTHONPATH")])),
                   VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT") or str(self.out.parent / "vllm-cache"))
        env.update(self.env)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.engine.multiprocess else "0"
        if self.engine.model_runner != "default":
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if self.engine.model_runner == "v2" else "0"
        argv = [str(vllm_python()), str(ENGINE), "--model", str(self.model), "--workload", str(self.workload),
                "--out", str(self.out), "--marker-dir", str(self.marker_dir), *self.engine.argv(self.kvbm)]
        return subprocess.Popen(argv, env=env, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)

    def finish(self, proc: subprocess.Popen) -> dict:
        try:
            rc = proc.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise EngineFailed(f"engine ran past {self.timeout_s:g}s (hang?); log {self.log}:\n{self._tail()}")
        if rc != 0:
            raise EngineFailed(f"engine exited {rc}; log {self.log}:\n{self._tail()}")
        result = json.loads(self.out.read_text())
        log = self.log.read_text(errors="replace")
        result["engine_log"] = {k: log.count(pattern) for k, pattern in ENGINE_LOG_COUNTS.items()}
        chosen = re.search(r"kvbm: load_mode auto -> (\w+)", log)
        result["engine_log"]["load_mode_auto"] = chosen.group(1) if chosen else None
        return result

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def outputs(result: dict) -> dict[str, list[int]]:
    return {req_id: rec["output"] for req_id, rec in result["records"].items()}


def differing(expected: dict, got: dict) -> list[dict]:
    """Requests whose tokens differ, with the first differing position."""
    diffs = []
    for req_id, want in outputs(expected).items():
        have = outputs(got).get(req_id)
        if have != want:
            first = next((i for i, (a, b) in enumerate(zip(want, have or [])) if a != b), min(len(want), len(have or [])))
            diffs.append({"id": req_id, "first_differing_token": first, "expected_len": len(want),
                          "got_len": len(have or [])})
    return diffs


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def engine_summary(result: dict) -> dict:
    """What vLLM says about one run: preemptions, tokens from kvbm, latency."""
    m, recs = result["metrics"], result["records"].values()
    ttft = [r.get("ttft") for r in recs]
    e2e = [r.get("e2e") for r in recs]
    return {"requests": len(result["records"]), "preemptions": m.get("vllm:num_preemptions", 0),
            "external_hit_tokens": m.get("vllm:external_prefix_cache_hits", 0),
            "local_hit_tokens": m.get("vllm:prefix_cache_hits", 0),
            "prompt_tokens": m.get("vllm:prompt_tokens", 0), "generated_tokens": m.get("vllm:generation_tokens", 0),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "longest_request_s": max((x for x in e2e if x is not None), default=None),
            "waves_s": [round(w["seconds"], 3) for w in result["waves"]], "startup_s": result.get("startup_s"),
            "engine_log": result.get("engine_log", {}), "vllm_version": result.get("vllm_version")}


def workload_key(workload: Path, engine: EngineConfig) -> str:
    h = hashlib.sha256(workload.read_bytes())
    same = replace(engine, load_mode="", early_loads=False, kvbm_extra={})  # what vLLM alone sees
    h.update(json.dumps(asdict(same), sort_keys=True).encode())
    return h.hexdigest()[:16]


def run_baseline(model: Path, workload: Workload, engine: EngineConfig, work: Path, name: str = "baseline",
                 timeout_s: float = 600.0) -> dict:
    """The workload served by vLLM without a connector (cached by workload and engine config)."""
    work.mkdir(parents=True, exist_ok=True)
    wl = workload.write(work / f"{name}.workload.json")
    out = work / f"{name}-{workload_key(wl, engine)}.json"
    if out.exists():
        return json.loads(out.read_text())
    run = Run(model, wl, out, engine, timeout_s=timeout_s)
    return run.finish(run.start())


def baseline_stability(model: Path, workload: Workload, engine: EngineConfig, work: Path,
                       first: dict | None = None) -> dict:
    """Serve the workload twice without kvbm, in other orders, another concurrency and another G1:
    greedy outputs must not depend on the batch they were computed in."""
    first = first or run_baseline(model, workload, engine, work)
    other = replace(engine, max_num_seqs=max(2, engine.max_num_seqs // 3), g1_bytes=engine.g1_bytes * 3)
    second = run_baseline(model, workload.reordered(7), other, work, name="baseline-reordered")
    return {"differing": differing(first, second),
            "first": {"max_num_seqs": engine.max_num_seqs, "g1_bytes": engine.g1_bytes, **engine_summary(first)},
            "second": {"max_num_seqs": other.max_num_seqs, "g1_bytes": other.g1_bytes, "order_seed": 7,
                       **engine_summary(second)}}


def run_pass(name: str, model: Path, workload: Workload, baseline: dict, engine: EngineConfig, node_cfg: NodeConfig,
             faults: list[Fault], work: Path, timeout_s: float = 600.0, trace: bool = False) -> dict:
    """One engine run through a fresh kvbm node, faults injected; compared with ``baseline``."""
    root = work / name
    root.mkdir(parents=True, exist_ok=True)
    worker_faults = tuple(kv for f in faults for kv in f.worker_faults())
    node = StressNode(root / "node", replace(node_cfg, faults=node_cfg.faults + worker_faults))
    started = time.time()
    env = {"DYN_KVBM_SOCKET_DIR": node.env["DYN_KVBM_SOCKET_DIR"]}
    if trace:  # one JSON line per connector decision (kvbm_client/connectors/vllm/worker.py)
        env["KVBM_CONNECTOR_TRACE"] = str(root / "connector-trace.jsonl")
    run = Run(model, workload.write(root / "workload.json"), root / "engine.json", engine, kvbm=True,
              env=env, timeout_s=timeout_s, src=node_cfg.src)
    proc = None
    injector = FaultInjector(node, faults, run.marker_dir, lambda: proc is not None and proc.poll() is None)
    try:
        node.start_all()
        proc = run.start()
        injector.start()
        result = run.finish(proc)
        injector.join()
        totals = node.totals()
        try:
            worker = dict(node.worker_status().counters)
        except Exception as exc:  # a worker killed and not back: say so, keep the pass
            worker = {"error": repr(exc)}
    finally:
        injector.stop()
        node.close()
    diffs = differing(baseline, result)
    return {"name": name, "faults": [f.describe() for f in faults], "node": asdict(node_cfg),
            "differing_count": len(diffs), "differing": diffs, **engine_summary(result),
            "kvbm": {k: totals.get(k, 0) for k in TIER_COUNTERS}, "worker": worker,
            "restarts": {k.value: v for k, v in node.restarts.items()},
            "fault_events": injector.events, "fault_errors": injector.errors,
            "injected": node.injected_faults(), "wall_s": round(time.time() - started, 1)}
