"""Multi-round QA against an OpenAI-compatible endpoint, in the spirit of LMBenchmark's
synthetic-multi-round-qa: N users share a system prompt, each has a long private context,
asks short questions and gets short answers; every round each user's history grows.

Two ways to run it:

  # against a server you started (any engine):
  python benchmarks/multi_round_qa.py --url http://127.0.0.1:8000 --model M

  # the comparison the README reports: vLLM (CPU build) without and with kvbm, one run
  python benchmarks/multi_round_qa.py --compare-vllm-cpu [--vllm-python .venv-vllm/bin/python]

Reports TTFT p50/p90 (time to the first streamed token), throughput and the share of prompt
tokens served from cache (``usage.prompt_tokens_details.cached_tokens``), for warm rounds
(round >= 1) apart from the cold round 0.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from provenance import provenance

REPO = Path(__file__).resolve().parents[1]


def build_workload(users: int, sys_len: int, ctx_len: int, seed: int = 7):
    rnd = random.Random(seed)
    toks = lambda n: [rnd.randrange(10, 1000) for _ in range(n)]
    system = toks(sys_len)
    return {u: system + toks(ctx_len) for u in range(users)}, rnd, toks


def one_request(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text_tokens, usage = None, [], {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            for ch in chunk.get("choices") or []:
                text_tokens.append(ch.get("text", ""))
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft": ttft, "total": time.perf_counter() - t0, "prompt_tokens": usage.get("prompt_tokens", len(prompt)),
            "cached": details.get("cached_tokens") or 0, "completion_tokens": usage.get("completion_tokens", 0),
            "text": "".join(text_tokens)}


def run_workload(url: str, model: str, args) -> dict:
    hist, rnd, toks = build_workload(args.users, args.sys_len, args.ctx_len)
    rows = []
    t_start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for r in range(args.rounds):
            for u in hist:
                hist[u] = hist[u] + toks(args.turn_len)
            users = list(hist)
            results = list(pool.map(lambda u: one_request(url, model, hist[u], args.max_tokens), users))
            for u, res in zip(users, results):
                rows.append({"round": r, "user": u, **res})
                hist[u] = hist[u] + toks(args.max_tokens)  # the answer joins the history
    wall = time.perf_counter() - t_start
    warm = [x for x in rows if x["round"] > 0]
    q = lambda v, p: sorted(v)[min(len(v) - 1, int(p * len(v)))]
    return {"ttft_p50_ms": statistics.median(x["ttft"] for x in warm) * 1e3,
            "ttft_p90_ms": q([x["ttft"] for x in warm], 0.9) * 1e3,
            "cold_ttft_p50_ms": statistics.median(x["ttft"] for x in rows if x["round"] == 0) * 1e3,
            "requests_per_s": len(rows) / wall,
            "prompt_tokens_per_s": sum(x["prompt_tokens"] for x in rows) / wall,
            "warm_hit_rate": sum(x["cached"] for x in warm) / max(1, sum(x["prompt_tokens"] for x in warm)),
            "outputs": [x["text"] for x in rows], "rows": rows}


def scrape(url: str, names: tuple[str, ...]) -> dict:
    out = {}
    try:
        body = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    except OSError:
        return out
    for line in body.splitlines():
        for n in names:
            if line.startswith(n + " ") or line.startswith(n + "{"):
                out[n] = out.get(n, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("server did not come up")


def compare_vllm_cpu(args) -> dict:
    from kvbm_client.local_node import LocalNode, isolated_env
    work = Path(tempfile.mkdtemp(prefix="kvbm-mrqa-"))
    model = work / "model"
    subprocess.run([args.vllm_python, str(REPO / "tests/vllm_support/make_tiny_model.py"), str(model)], check=True,
                   capture_output=True)
    env = isolated_env(work, {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": args.g2_blocks,
                              "VLLM_CACHE_ROOT": work / "vc", "VLLM_CPU_OMP_THREADS_BIND": "0"})
    results = {}
    with LocalNode(env, 1, log_dir=work) as kvbm:
        kvbm.start()
        for system in ("baseline", "kvbm"):
            port = 18000 + random.randrange(1000)
            cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                   "--port", str(port), "--host", "127.0.0.1", "--enforce-eager", "--block-size", "32",
                   "--max-model-len", str(args.max_len), "--kv-cache-memory-bytes", str(args.g1_bytes),
                   "--enable-prompt-tokens-details", "--served-model-name", "tiny"]
            if system == "kvbm":
                cmd += ["--kv-transfer-config", json.dumps({
                    "kv_connector": "KvbmConnector", "kv_connector_module_path": "kvbm_client.connectors.vllm",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute"})]
            server = subprocess.Popen(cmd, env=env, stdout=open(work / f"{system}.log", "wb"), stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"
            try:
                wait_http(url, server)
                res = run_workload(url, "tiny", args)
                res["metrics"] = scrape(url, ("vllm:external_prefix_cache_hits_total",
                                              "vllm:prefix_cache_hits_total"))
                results[system] = res
            finally:
                server.send_signal(signal.SIGINT)
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    server.kill()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url")
    p.add_argument("--model", default="tiny")
    p.add_argument("--compare-vllm-cpu", action="store_true")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--sys-len", type=int, default=512)
    p.add_argument("--ctx-len", type=int, default=768)
    p.add_argument("--turn-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--g1-bytes", type=int, default=6 << 20, help="vLLM KV cache (G1) bytes")
    p.add_argument("--g2-blocks", type=int, default=2048, help="kvbm G2 blocks")
    p.add_argument("--json", help="write the full results here")
    args = p.parse_args()
    record = provenance()
    if args.compare_vllm_cpu:
        results = compare_vllm_cpu(args)
    elif args.url:
        results = {"endpoint": run_workload(args.url, args.model, args)}
    else:
        p.error("give --url or --compare-vllm-cpu")
    for name, r in results.items():
        print(f"{name:9s} warm TTFT p50 {r['ttft_p50_ms']:7.1f} ms  p90 {r['ttft_p90_ms']:7.1f} ms  "
              f"cold p50 {r['cold_ttft_p50_ms']:7.1f} ms  {r['requests_per_s']:.2f} req/s  "
              f"{r['prompt_tokens_per_s']:.0f} prompt tok/s  warm hit rate {r['warm_hit_rate']:.2f}  "
              f"{r.get('metrics', {})}")
    if "baseline" in results and "kvbm" in results:
        b, k = results["baseline"], results["kvbm"]
        print(f"kvbm / baseline: warm TTFT p50 {k['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x, "
              f"p90 {k['ttft_p90_ms'] / b['ttft_p90_ms']:.2f}x, throughput {k['requests_per_s'] / b['requests_per_s']:.2f}x, "
              f"hit rate {b['warm_hit_rate']:.2f} -> {k['warm_hit_rate']:.2f}, "
              f"outputs identical: {b['outputs'] == k['outputs']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": record, **{n: {k: v for k, v in r.items() if k != 'rows'}
                                                                          for n, r in results.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
