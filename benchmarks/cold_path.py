"""A cold request's cost on the engine's scheduler thread before its first forward, through the
connector's own scheduler core against a real node: the lookup (vLLM's
``get_num_new_matched_tokens``) and the first step (``build_connector_meta``), then the CPU work
that follows on the engine's thread (vLLM enqueuing the forward) while the store planner's thread
runs beside it.

    python3 benchmarks/cold_path.py [--tokens 20128] [--step-tokens 16384] [--reps 40] [--passes 4]
                                    [--enqueue-ms 20] [--json out.json]

Variants, alternating within each pass (the order reversed every second pass):

* ``asked``: ``presence_filter`` false, every lookup a ``PrepareLoad`` round trip; the lookup
  hashes the whole prompt on the scheduler thread (the behaviour before the twelfth session);
* ``filter``: the default: the leader's presence filter rules out the first block, no round
  trip, one block probed; the first step's blocks are hashed on the store planner's thread.

Both plan the first step's stores on the planner's thread (``async_store_plans``, 64-block
threshold). Per request, ms from the lookup's start: ``lookup`` and ``step`` (each on the calling
thread); ``enqueue``: what the engine's thread does next, 36 "layers" of a CPU-bound Python loop
calibrated to ``--enqueue-ms`` in all (it slows down when the planner's thread takes the
interpreter lock); ``first_layer``: when the first layer was enqueued (the GPU's first work);
``gpu_end``: when a GPU that takes ``--gpu-layer-ms`` per layer, starting each once it is
enqueued and the previous one ran, would end the step (a model: the first step of a 20K cold
prefill on an H100 took ~350 ms). The next step collects the plan (untimed). A leader and one CPU worker
run as child processes (real gRPC over unix sockets); its G2 holds every planned store.

What it leaves out: vLLM itself, the GPU (an H100 host's 20K cold lookup round trip was 2.0-4.9 ms
and its hashing 1.6-4.6 ms in vLLM, 2026-11-26 eleventh session's traces).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from provenance import provenance

from kvbm_client import KvbmClient, KvbmConfig, ShmKvBuffer
from kvbm_client.connectors.core import ConnectorSettings, RequestExtras, SchedulerCore
from kvbm_client.connectors.core.leader_link import LeaderLink
from kvbm_client.connectors.core.store_planner import StorePlanner
from kvbm_client.local_node import LocalNode, isolated_env

BS = 16
VARIANTS = ("asked", "filter")
FIELDS = ("lookup", "step", "enqueue", "first_layer", "gpu_end")
LAYERS = 36


@dataclass
class Request:
    request_id: str
    all_token_ids: list[int]
    extras: RequestExtras = field(default_factory=RequestExtras)


def calibrate(target_ms: float) -> int:
    """Iterations of :func:`busy` that take about ``target_ms`` on this machine, alone."""
    n = 10_000
    while True:
        t = time.perf_counter()
        busy(n)
        ms = (time.perf_counter() - t) * 1e3
        if ms > 2:
            return max(1, int(n * target_ms / ms))
        n *= 4


def busy(n: int) -> int:
    x = 0
    for i in range(n):
        x += i & 7
    return x


def one_pass(env: dict[str, str], address: str, variant: str, tokens: int, step_tokens: int, reps: int,
             spin: int, salt: int, gpu_layer_s: float) -> dict[str, list[float]]:
    settings = ConnectorSettings(address, "unix:/unused-{id}", "cold-path|bf16|16", 10.0, 1.0,
                                 config=KvbmConfig.from_env(env), presence_filter=variant == "filter")
    planner = StorePlanner(LeaderLink(settings, "cold-path-stores"), min_keys=64)
    core = SchedulerCore(BS, settings, LeaderLink(settings, "cold-path"), lambda r: r.extras,
                         store_planner=planner)
    out: dict[str, list[float]] = {f: [] for f in FIELDS}
    blocks = list(range(tokens // BS + 1))
    try:
        for i in range(reps + 5):  # the first 5 warm up and are dropped
            base = (salt * 1000 + i) * tokens
            req = Request(f"r{salt}-{i}", [(base + t) % 150_000 for t in range(tokens)])
            t0 = time.perf_counter()
            assert core.lookup(req, 0) == (0, False), "a cold request matched"
            t1 = time.perf_counter()
            core.allocated(req.request_id, blocks, 0)
            core.assign_blocks(req.request_id, blocks, replace=True)
            core.step({req.request_id: step_tokens})
            t2 = time.perf_counter()
            enqueued = []  # when each layer's kernels were enqueued
            for _ in range(LAYERS):
                busy(spin)
                enqueued.append(time.perf_counter())
            t3 = time.perf_counter()
            gpu = t2  # a GPU that runs each layer gpu_layer_s after it is enqueued and the previous one ran
            for at in enqueued:
                gpu = max(gpu, at) + gpu_layer_s
            plan = core.step({})  # the next step collects the plan
            assert plan.earlier_stores and len(plan.earlier_stores[0].engine_blocks) == step_tokens // BS, \
                "the first step's stores were not planned whole"
            core.finished(req.request_id)
            core.step({})
            if i >= 5:
                for f, v in zip(FIELDS, (t1 - t0, t2 - t1, t3 - t2, enqueued[0] - t0, gpu - t0)):
                    out[f].append(v * 1e3)
    finally:
        core.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20128, help="prompt tokens of each cold request [20128]")
    ap.add_argument("--step-tokens", type=int, default=16384, help="tokens of its first step [16384]")
    ap.add_argument("--reps", type=int, default=40, help="timed requests per variant and pass [40]")
    ap.add_argument("--passes", type=int, default=4, help="alternating passes [4]")
    ap.add_argument("--enqueue-ms", type=float, default=20.0,
                    help="the engine's CPU work after the step, enqueuing 36 layers [20]")
    ap.add_argument("--gpu-layer-ms", type=float, default=9.7,
                    help="the modelled GPU time of one layer of the first step [9.7: 350 ms / 36]")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    record = provenance()
    spin = calibrate(args.enqueue_ms / LAYERS)
    step_blocks = args.step_tokens // BS
    per: dict[str, list[dict[str, list[float]]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="kvbm-cold-", dir="/tmp") as tmp:
        root = Path(tmp)
        pool = step_blocks * (args.reps + 5) * len(VARIANTS) * args.passes + 64  # every planned store stays
        env = isolated_env(root, {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(pool), "DYN_LOG": "warning",
                                  "DYN_KVBM_HOST_FREE_WATERMARK": "0", "DYN_KVBM_JOB_TIMEOUT_SECS": "600"})
        with LocalNode(env, 1, log_dir=root).start() as node:
            config = KvbmConfig.from_env(env)
            engine = ShmKvBuffer(args.tokens // BS + 1, 1, 256, directory=str(root))
            client = KvbmClient(config)
            try:
                client.register_region("0", engine.spec())
                client.wait_ready(120)
                salt = 0
                for p in range(args.passes):
                    for variant in (VARIANTS if p % 2 == 0 else VARIANTS[::-1]):
                        salt += 1
                        got = one_pass(env, node.leader_address, variant, args.tokens, args.step_tokens, args.reps,
                                       spin, salt, args.gpu_layer_ms / 1e3)
                        per[variant].append(got)
                        print(f"pass {p} {variant}: " + ", ".join(f"{f} {statistics.median(got[f]):.3f}"
                                                                 for f in FIELDS) + " ms (p50)", flush=True)
            finally:
                client.close()
                engine.close()
    rows = []
    for variant, passes in per.items():
        row = {"variant": variant}
        for f in FIELDS:
            p50s = [statistics.median(x[f]) for x in passes]
            row[f] = round(statistics.median(p50s), 3)
            row[f + "_per_pass"] = [round(x, 3) for x in p50s]
        rows.append(row)
        print(f"{variant}: " + ", ".join(f"{f} {row[f]:.3f}" for f in FIELDS) + " ms (median of the passes' p50)")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": record, "args": vars(args), "spin_iterations": spin,
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
