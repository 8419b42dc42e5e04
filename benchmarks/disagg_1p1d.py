"""TTFT of disaggregated prefill/decode (1P1D) with and without kvbm, against aggregated serving.

    # two GPUs (vLLM 0.26 from the wheel bundle, NIXL from it too): the README's table
    python3 benchmarks/disagg_1p1d.py --platform gpu --systems agg,pd,pd_kvbm --passes 2 \
        --json benchmarks/results/disagg_1p1d_h200x2_DATE.json
    # the CPU build (vLLM 0.32, tiny model, NIXL over UCX on one host): the mechanism, not speed
    python benchmarks/disagg_1p1d.py --platform cpu --json /tmp/disagg_cpu.json

Systems (``tests/disagg/harness.py``): ``agg`` one engine; ``agg_kvbm`` one engine with kvbm;
``pd`` a prefill and a decode engine with NixlConnector behind ``kvbm_client.tools.disagg_proxy``;
``pd_kvbm`` the same with kvbm on the prefill engine (MultiConnector). Every pass starts each
system afresh (engines, proxy and kvbm node), in the order given, and runs the same multi-round
workload (``multi_round_qa.build_workload``: users with a shared system prompt and a private
context; each round appends a question, the answer joins the history); the prefill engine's G1
is too small to keep every user's history, so a returning prefix must come from kvbm or be
recomputed. Reported per system: TTFT (first streamed token at the client, through the proxy
for 1P1D) p50/p90 of the warm rounds, medians over passes; the cold round apart; the prompt
tokens the caching engine (aggregated or prefill) got from an external source per round (vLLM's
``external_prefix_cache_hits``) and kvbm's counters; NIXL transfers seen by the decode engine;
and whether every greedy output equals the first system's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from multi_round_qa import build_workload, scrape
from provenance import provenance

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "disagg"))
import harness  # noqa: E402  (tests/disagg/harness.py: the deployments)

#: Counters read from the caching engine (aggregated or prefill) and the decode engine.
ENGINE_METRICS = ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                  "vllm:prompt_tokens_total", "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_num_failed_transfers_total")
KVBM_COUNTERS = ("kvbm_matched_tokens", "kvbm_onboard_blocks_h2d", "kvbm_onboard_blocks_d2d", "kvbm_offload_blocks_d2h",
                 "kvbm_failed_jobs")
QWEN3_4B_SHAPE = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": True, "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645}


def stream_request(url: str, prompt: list[int], max_tokens: int, timeout_s: float = 600) -> dict:
    """One streamed completion: TTFT at the client, the output token ids, cached prompt tokens."""
    body = json.dumps({"model": harness.SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, tokens, usage = None, [], {}
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(choice.get("token_ids") or [])
            usage = chunk.get("usage") or usage
    return {"ttft": ttft, "output": tokens, "prompt_tokens": usage.get("prompt_tokens", len(prompt)),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


def snapshot(dep: harness.Deployment, node) -> dict:
    """Cumulative counters of the deployment's engines and kvbm node, now."""
    snap = {"caching": scrape(dep.caching_engine.url, ENGINE_METRICS)}
    if harness.Role.DECODE in dep.engines:
        snap["decode"] = scrape(dep.engines[harness.Role.DECODE].url, ENGINE_METRICS)
    if node is not None:
        counters = dict(node.status(5.0).counters)
        snap["kvbm"] = {k: counters.get(k, 0.0) for k in KVBM_COUNTERS}
    return snap


def delta(after: dict, before: dict) -> dict:
    return {side: {k: v - before.get(side, {}).get(k, 0.0) for k, v in vals.items()} for side, vals in after.items()}


def run_workload(dep: harness.Deployment, node, args) -> dict:
    """The multi-round workload, one request at a time; counters per round."""
    hist, _, toks = build_workload(args.users, args.sys_len, args.ctx_len, seed=args.seed)
    rows, rounds = [], []
    before = snapshot(dep, node)
    for r in range(args.rounds):
        for u in hist:
            hist[u] = hist[u] + toks(args.turn_len)
            res = stream_request(dep.url, hist[u], args.max_tokens)
            rows.append({"round": r, "user": u, **res})
            hist[u] = hist[u] + res["output"]  # the answer joins the history (greedy: the same everywhere)
        after = snapshot(dep, node)
        rounds.append(delta(after, before))
        before = after
    warm = [x["ttft"] for x in rows if x["round"] > 0]
    return {"rows": rows, "rounds": rounds,
            "ttft_p50_ms": statistics.median(warm) * 1e3,
            "ttft_p90_ms": statistics.quantiles(warm, n=10)[-1] * 1e3 if len(warm) > 1 else warm[0] * 1e3,
            "cold_ttft_p50_ms": statistics.median(x["ttft"] for x in rows if x["round"] == 0) * 1e3}


def run_system(platform: harness.Platform, system: harness.System, work: Path, args) -> dict:
    """Start ``system`` afresh (with a fresh kvbm node when it uses kvbm), run, stop."""
    from kvbm_client.local_node import LocalNode, isolated_env
    log_dir = Path(tempfile.mkdtemp(prefix=f"{system.name}-", dir=work))
    node, kvbm_env = None, None
    try:
        if system.kvbm:
            kvbm_env = isolated_env(log_dir, {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": args.g2_blocks} if args.g2_blocks
                                    else {"DYN_KVBM_CPU_CACHE_GB": args.g2_gb})
            node = LocalNode(kvbm_env, 1, gpus=[platform.devices[0]] if platform.devices[0] is not None else None,
                             log_dir=log_dir, own_session=True)
            # NOTE: own_session: the node in a session of its own, as the engines (harness) and a systemd
            # unit are. With sched_autogroup on (most distributions) the kernel shares the CPU between
            # sessions first; in this process's session the leader competed with whatever else ran
            # there and waited up to 30 s on a run queue on 2 cores (README, "The leader never stalls").
            node.start(timeout=300)
        t0 = time.monotonic()
        with harness.Deployment(platform, system, log_dir, kvbm_env=kvbm_env) as dep:
            start_s = time.monotonic() - t0
            with urllib.request.urlopen(dep.caching_engine.url + "/version", timeout=10) as resp:
                version = json.loads(resp.read()).get("version")  # the engines' vLLM, not this process's
            result = run_workload(dep, node, args)
            result["vllm_version"] = version
        result.update(system=system.name, start_s=round(start_s, 1), logs=str(log_dir))
        return result
    finally:
        if node is not None:
            node.stop()


def cpu_platform(args, work: Path) -> harness.Platform:
    python = os.environ.get("KVBM_VLLM_VENV", str(REPO / ".venv-vllm")) + "/bin/python"
    model = work / "tiny-llama"
    subprocess.run([python, str(REPO / "tests/vllm_support/make_tiny_model.py"), str(model)], check=True,
                   capture_output=True)
    site = subprocess.run(["bash", str(REPO / "tests/disagg/install_nixl.sh"), python], check=True,
                          capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return harness.Platform(python=python, model=str(model), block_size=32, max_model_len=args.max_len,
                            engine_args=("--dtype", "float32", "--kv-cache-memory-bytes", str(args.g1_bytes)),
                            extra_pythonpath=(site,), env={"VLLM_CACHE_ROOT": str(work / "vllm-cache")})


def gpu_platform(args, work: Path) -> harness.Platform:
    model = work / "qwen3-4b-shape"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_4B_SHAPE))
    return harness.Platform(python=sys.executable, model=str(model), block_size=16, max_model_len=args.max_len,
                            engine_args=("--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
                                         "--kv-cache-memory-bytes", str(args.g1_bytes)),
                            devices=(0, 1), env={"HF_HUB_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0",
                                                 "VLLM_CACHE_ROOT": str(work / "vllm-cache")},
                            start_timeout_s=600)


def summarize(results: dict[str, list[dict]]) -> dict:
    """Medians over passes per system, and output equality against the first system."""
    names = list(results)
    reference = [r["output"] for r in results[names[0]][0]["rows"]]
    table = {}
    for name, passes in results.items():
        warm_rounds = [rd for p in passes for rd in p["rounds"][1:]]
        table[name] = {
            "ttft_p50_ms": statistics.median(p["ttft_p50_ms"] for p in passes),
            "ttft_p90_ms": statistics.median(p["ttft_p90_ms"] for p in passes),
            "cold_ttft_p50_ms": statistics.median(p["cold_ttft_p50_ms"] for p in passes),
            "warm_external_hit_tokens": sum(rd["caching"].get(ENGINE_METRICS[0], 0.0) for rd in warm_rounds),
            "warm_kvbm_onboard_blocks": sum(rd.get("kvbm", {}).get("kvbm_onboard_blocks_h2d", 0.0) for rd in warm_rounds),
            "decode_nixl_transfers": sum(rd.get("decode", {}).get(ENGINE_METRICS[3], 0.0) for p in passes
                                         for rd in p["rounds"]),
            "outputs_equal_first": all([r["output"] for r in p["rows"]] == reference for p in passes),
            "outputs_equal_to": [other for other, theirs in results.items() if other != name and all(
                [r["output"] for r in p["rows"]] == [r["output"] for r in q["rows"]] for p in passes for q in theirs)]}
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--systems", default="agg,pd,pd_kvbm", help=f"comma-separated, of {sorted(harness.SYSTEMS)}")
    p.add_argument("--passes", type=int, default=1, help="each pass runs every system once, in order")
    p.add_argument("--users", type=int)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sys-len", type=int)
    p.add_argument("--ctx-len", type=int)
    p.add_argument("--turn-len", type=int)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-len", type=int)
    p.add_argument("--g1-bytes", type=int, help="KV cache (G1) of every engine, bytes")
    p.add_argument("--g2-gb", type=float, default=24.0, help="kvbm G2 (GPU platform)")
    p.add_argument("--g2-blocks", type=int, help="kvbm G2 in blocks (default on CPU: 1024)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--work", help="directory for models and logs (default: a new temporary one)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--append", action="store_true",
                   help="add this run's passes to those already in --json (one pass per command where a "
                        "command's time is limited); the table covers them all")
    args = p.parse_args()
    # Defaults per platform: the CPU run is the tiny model on 2 cores; the GPU run is the 8K-ish
    # multi-round shape of the aggregated table (Qwen3-4B shape), G1 too small for every history.
    cpu = args.platform == "cpu"
    for name, cpu_default, gpu_default in (("users", 4, 8), ("sys_len", 128, 1024), ("ctx_len", 256, 6144),
                                           ("turn_len", 64, 256), ("max_len", 896, 16384),
                                           ("g1_bytes", 4 << 20, 3 << 30), ("g2_blocks", 1024, None)):
        if getattr(args, name) is None:
            setattr(args, name, cpu_default if cpu else gpu_default)
    record = provenance()
    work = Path(args.work or tempfile.mkdtemp(prefix="kvbm-disagg-"))
    work.mkdir(parents=True, exist_ok=True)
    platform = cpu_platform(args, work) if cpu else gpu_platform(args, work)
    systems = [harness.SYSTEMS[s] for s in args.systems.split(",")]
    results: dict[str, list[dict]] = {s.name: [] for s in systems}
    runs = [record]
    if args.append and args.json and Path(args.json).exists():
        previous = json.loads(Path(args.json).read_text())
        runs = previous.get("runs", [previous.get("provenance")]) + runs
        for name, passes in previous["passes"].items():
            results.setdefault(name, [])[:0] = passes
    for i in range(args.passes):
        for system in systems:
            res = run_system(platform, system, work, args)
            results[system.name].append(res)
            print(f"pass {i} {system.name:9s} warm TTFT p50 {res['ttft_p50_ms']:8.1f} ms p90 {res['ttft_p90_ms']:8.1f} ms"
                  f"  cold p50 {res['cold_ttft_p50_ms']:8.1f} ms  per round {json.dumps(res['rounds'])}", flush=True)
    table = summarize(results)
    print(f"{'system':9s} {'p50 ms':>9s} {'p90 ms':>9s} {'cold p50':>9s} {'ext. hits':>10s} {'kvbm blk':>9s} "
          f"{'nixl xfers':>10s} outputs")
    for name, row in table.items():
        print(f"{name:9s} {row['ttft_p50_ms']:9.1f} {row['ttft_p90_ms']:9.1f} {row['cold_ttft_p50_ms']:9.1f} "
              f"{row['warm_external_hit_tokens']:10.0f} {row['warm_kvbm_onboard_blocks']:9.0f} "
              f"{row['decode_nixl_transfers']:10.0f} equal to {row['outputs_equal_to']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": record, "runs": runs, "args": vars(args),
                                               "table": table, "passes": results}, indent=1))
    return 0 if all(row["outputs_equal_first"] for row in table.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
