"""Run the stress harness by hand: baseline stability, then one pass per fault.

    PYTHONPATH=$PWD KVBM_VLLM_VENV=.venv-vllm .venv/bin/python -m tests.stress.run \\
        --users 32 --turns 4 --passes none,sigstop,kill-worker,kill-leader,disk-eio \\
        --out benchmarks/results/stress_cpu.json

Every pass serves the same seeded workload through a fresh kvbm node and compares each
request's greedy tokens with the baseline (vLLM without a connector). The result file
records the commit, argv and machine. Exit status 1 when any output differs or a pass failed.
GPU (vLLM 0.26): ``--async-scheduling on --block-size 16 [--cuda-graphs] --dtype bfloat16``
(check the baseline stability there first: bf16 on a GPU is not batch-invariant by default).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .faults import Fault, FaultKind
from .harness import EngineConfig, EngineFailed, baseline_stability, ensure_model, run_baseline, run_pass
from .node import REPO, NodeConfig
from .workload import WorkloadSpec, generate

sys.path.insert(0, str(REPO / "benchmarks"))
from provenance import provenance  # noqa: E402  (the record every benchmark result starts with)

PASSES = ("none", "sigstop", "kill-worker", "kill-leader", "disk-eio", "kill-mid-load")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="kvbm stress harness (issue 17)")
    w = p.add_argument_group("workload")
    w.add_argument("--users", type=int, default=32)
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--groups", type=int, default=6, help="shared prefixes")
    w.add_argument("--seed", type=int, default=1)
    e = p.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int, default=8, help="concurrency")
    e.add_argument("--g1-mib", type=float, default=3.0, help="vLLM kv_cache_memory_bytes")
    e.add_argument("--max-model-len", type=int, default=640)
    e.add_argument("--block-size", type=int, default=32)
    e.add_argument("--dtype", default="float32")
    e.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto")
    e.add_argument("--cuda-graphs", action="store_true")
    e.add_argument("--load-mode", choices=("auto", "sync", "async", "layerwise"), default="auto",
                   help="the connector's load_mode (auto: its default, see compat.auto_load_mode)")
    e.add_argument("--model-runner", choices=("default", "v1", "v2"), default="default",
                   help="vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER; default: vLLM's choice)")
    e.add_argument("--no-early-loads", action="store_true")
    e.add_argument("--kvbm-extra", type=json.loads, default={}, metavar="JSON",
                   help='more kv_connector_extra_config for kvbm, e.g. \'{"gpu_layer_waits": true}\'')
    n = p.add_argument_group("kvbm node")
    n.add_argument("--g2-blocks", type=int, default=48)
    n.add_argument("--g3-blocks", type=int, default=512)
    n.add_argument("--job-timeout", type=float, default=5.0, help="DYN_KVBM_JOB_TIMEOUT_SECS of the fault passes")
    n.add_argument("--no-nixl", action="store_true")
    n.add_argument("--stage-mib", type=float, default=0.0, metavar="MIB",
                   help="the worker's staging area (kvbm-worker --stage-mib; GPU only): a layerwise load's "
                        "first layer group is copied there as soon as it is matched [default: 0, none]")
    n.add_argument("--node-env", action="append", default=[], metavar="DYN_KVBM_NAME=VALUE",
                   help="a further node setting (repeatable), e.g. DYN_KVBM_STORE_DEMOTION_MB=0")
    n.add_argument("--gpu", type=int, default=None, help="the worker serves this CUDA device (GPU engine)")
    n.add_argument("--kvbm-src", default="", help="a checkout whose connector and daemons run [default: this one]")
    f = p.add_argument_group("faults")
    f.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated, of {', '.join(PASSES)}")
    f.add_argument("--fault-wave", type=int, default=1)
    f.add_argument("--fault-delay", type=float, default=1.0, help="seconds after the wave started")
    f.add_argument("--sigstop-secs", type=float, default=35.0,
                   help="longer than the connector's waits (job timeout + 5 s) and the old fixed 30 s")
    f.add_argument("--down-secs", type=float, default=2.0, help="a killed daemon's time before restart")
    f.add_argument("--eio-every", default="3",
                   help="the disk-eio pass: every K-th G3 read/write fails (KVBM_FAULT_DISK_EIO_EVERY)")
    f.add_argument("--group-delay", type=float, default=1.0,
                   help="the kill-mid-load pass (--load-mode layerwise): each layer group of a load after "
                        "the first lands this many seconds late (KVBM_FAULT_GROUP_DELAY_SECS); the worker is "
                        "killed --fault-delay-mid-load seconds after the first group was held back")
    f.add_argument("--fault-delay-mid-load", type=float, default=0.1,
                   help="the kill-mid-load pass: seconds after a load began holding back a group")
    p.add_argument("--skip-baseline-check", action="store_true")
    p.add_argument("--tag", default="", help="suffix of the pass directories (several runs in one --work)")
    p.add_argument("--debug", action="store_true", help="DYN_LOG=debug on the node, connector trace in the engine")
    p.add_argument("--work", default="", help="work directory [default: a new one under /tmp]")
    p.add_argument("--model-dir", default=os.path.join(os.environ.get("XDG_CACHE_HOME", "/tmp"), "kvbm-stress-model"))
    p.add_argument("--timeout", type=float, default=900.0, help="per engine run")
    p.add_argument("--out", default="", help="result JSON")
    return p.parse_args(argv)


def node_settings(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    """``--node-env`` values: ``DYN_KVBM_NAME=VALUE`` each (anything else is an argument error)."""
    out = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.startswith("DYN_KVBM_"):
            raise SystemExit(f"--node-env {pair!r}: expected DYN_KVBM_NAME=VALUE")
        out.append((name, value))
    return tuple(out)


def fault_of(name: str, args) -> list[Fault]:
    kind = {k.value: k for k in FaultKind}.get(name)
    if name == "none":
        return []
    if kind is FaultKind.SIGSTOP:
        return [Fault(kind, args.fault_wave, args.fault_delay, args.sigstop_secs)]
    if kind in (FaultKind.KILL_WORKER, FaultKind.KILL_LEADER):
        return [Fault(kind, args.fault_wave, args.fault_delay, args.down_secs)]
    if kind is FaultKind.DISK_EIO:
        return [Fault(kind, spec=args.eio_every)]
    if kind is FaultKind.KILL_MID_LOAD:
        if args.load_mode != "layerwise":
            raise SystemExit("the kill-mid-load pass needs --load-mode layerwise (only those loads land in groups)")
        if not args.group_delay > args.fault_delay_mid_load:
            raise SystemExit("--group-delay must be longer than --fault-delay-mid-load (the kill must come "
                             "while the group is held)")
        return [Fault(kind, delay_s=args.fault_delay_mid_load, duration_s=args.down_secs, spec=f"{args.group_delay:g}")]
    raise SystemExit(f"unknown pass {name!r}; one of {', '.join(PASSES)}")


def unstaged_error(outcome: dict) -> str | None:
    """A pass run with a staging area proves nothing about staged loads unless one was used (the
    worker's ``staged_loads_used``; not judged when the worker restarted: its counters began again)."""
    worker = outcome.get("worker", {})
    if "error" in worker or outcome.get("restarts", {}).get("worker"):
        return None
    if not worker.get("staged_loads_used"):
        return (f"--stage-mib was set but no load used a stage (the worker staged {worker.get('loads_staged', 0):g} "
                "and used none)")
    return None


def mid_load_error(outcome: dict) -> str | None:
    """A kill-mid-load pass proves nothing unless the kill struck and the engine saw a load fail."""
    if outcome.get("fault_errors"):
        return "the kill did not strike: " + "; ".join(outcome["fault_errors"])
    if not outcome.get("engine_log", {}).get("loads_failed"):
        return "the worker was killed but no load failed in the engine (the kill hit no load)"
    return None


def src_diff(src: str) -> str:
    """What another checkout (``--kvbm-src``) changes in the kvbm packages, as a unified diff."""
    if not src:
        return ""
    return "".join(subprocess.run(["diff", "-ru", "-x", "__pycache__", str(REPO / pkg), str(Path(src) / pkg)],
                                  capture_output=True, text=True).stdout
                   for pkg in ("kvbm_client", "kvbm_leader", "kvbm_worker"))


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = node_settings(args.node_env)  # a bad --node-env fails now, not after the baseline ran
    passes = [(name, fault_of(name, args)) for name in args.passes.split(",")]  # so does a bad pass
    work = Path(args.work or f"/tmp/kvbm-stress-{time.strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)
    model = ensure_model(Path(args.model_dir))
    spec = WorkloadSpec(users=args.users, turns=args.turns, groups=args.groups, seed=args.seed,
                        max_prompt_len=args.max_model_len - 8)
    workload = generate(spec)
    engine = EngineConfig(g1_bytes=int(args.g1_mib * (1 << 20)), max_num_seqs=args.max_num_seqs,
                          max_model_len=args.max_model_len, block_size=args.block_size, dtype=args.dtype,
                          async_scheduling=args.async_scheduling, cuda_graphs=args.cuda_graphs,
                          load_mode=args.load_mode, early_loads=not args.no_early_loads,
                          model_runner=args.model_runner, kvbm_extra=args.kvbm_extra)
    result = {**provenance(), "loadavg_at_start": os.getloadavg(), "workload": spec.__dict__, "engine": engine.__dict__, "kvbm_src": args.kvbm_src,
              "kvbm_src_diff": src_diff(args.kvbm_src), "passes": []}
    baseline = run_baseline(model, workload, engine, work)
    if not args.skip_baseline_check:
        result["baseline_stability"] = baseline_stability(model, workload, engine, work, baseline)
    failed = bool(result.get("baseline_stability", {}).get("differing"))
    for name, faults in passes:
        node = NodeConfig(g2_blocks=args.g2_blocks, g3_blocks=args.g3_blocks, no_nixl=args.no_nixl,
                          stage_mib=args.stage_mib, job_timeout_s=30.0 if name == "none" else args.job_timeout,
                          log_level="debug" if args.debug else "info", src=args.kvbm_src, gpu=args.gpu,
                          settings=settings)
        try:
            outcome = run_pass(name + args.tag, model, workload, baseline, engine, node, faults, work,
                               timeout_s=args.timeout, trace=args.debug)
        except EngineFailed as exc:
            outcome = {"name": name, "error": str(exc)}
        if name == "kill-mid-load" and not outcome.get("error") and (error := mid_load_error(outcome)):
            outcome["error"] = error
        if args.stage_mib and not outcome.get("error") and (error := unstaged_error(outcome)):
            outcome["error"] = error
        failed |= bool(outcome.get("error") or outcome.get("differing_count"))
        result["passes"].append(outcome)
        print(json.dumps({k: v for k, v in outcome.items() if k not in ("differing", "node")}), flush=True)
        if args.out:  # after each pass: a long run that is stopped keeps what it measured
            Path(args.out).write_text(json.dumps(result, indent=1))
    result["loadavg_at_end"] = os.getloadavg()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
