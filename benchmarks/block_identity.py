"""What kvbm's block identity costs on the TTFT path: hashing a new request's prompt.

    python benchmarks/block_identity.py [--tokens 20000] [--block-sizes 16,32] [--passes 15]
                                        [--out benchmarks/results/block_identity_<host>.json]

A connector's scheduler role hashes a request's full blocks once, at its first lookup
(``BlockIdentity.update`` over the prompt), then one block at a time as it decodes. This
times the first (a fresh identity per pass, the token list as vLLM holds it: Python ints)
and the per-block increment, alternating block sizes within each pass; medians and minima.
Writes one JSON file with the commit, argv and machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbm_client.hashing import BlockIdentity, RequestExtras  # noqa: E402


def provenance() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")), "argv": sys.argv,
            "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                        "cpus": os.cpu_count(), "python": platform.python_version(),
                        "load_avg": os.getloadavg()}}


def time_prompt(tokens: list[int], block_size: int) -> float:
    identity = BlockIdentity("meta-llama/Llama-3.1-8B-Instruct|torch.bfloat16|%d" % block_size, block_size,
                             RequestExtras(cache_salt="tenant-a"))
    t0 = time.perf_counter()
    identity.update(tokens)
    return time.perf_counter() - t0


def time_decode_block(tokens: list[int], block_size: int) -> float:
    identity = BlockIdentity("m|bf16|%d" % block_size, block_size)
    identity.update(tokens)
    grown = tokens + [7] * block_size
    t0 = time.perf_counter()
    identity.update(grown)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=20_000)
    p.add_argument("--block-sizes", default="16,32")
    p.add_argument("--passes", type=int, default=15)
    p.add_argument("--out", default="")
    args = p.parse_args()
    rnd = random.Random(0)
    tokens = [rnd.randrange(0, 128_256) for _ in range(args.tokens)]
    sizes = [int(x) for x in args.block_sizes.split(",")]
    prompt: dict[int, list[float]] = {bs: [] for bs in sizes}
    decode: dict[int, list[float]] = {bs: [] for bs in sizes}
    for _ in range(args.passes):
        for bs in sizes:  # alternate within a pass: drift on a shared machine hits every size alike
            prompt[bs].append(time_prompt(tokens, bs))
            decode[bs].append(time_decode_block(tokens, bs))
    results = [{"block_size": bs, "prompt_tokens": args.tokens, "blocks": args.tokens // bs,
                "prompt_ms_median": round(statistics.median(prompt[bs]) * 1e3, 3),
                "prompt_ms_min": round(min(prompt[bs]) * 1e3, 3),
                "decode_block_us_median": round(statistics.median(decode[bs]) * 1e6, 2)} for bs in sizes]
    for r in results:
        print(f"block_size {r['block_size']:>3}: {r['prompt_tokens']}-token prompt ({r['blocks']} blocks) "
              f"{r['prompt_ms_median']:.3f} ms median ({r['prompt_ms_min']:.3f} min); "
              f"one more block while decoding {r['decode_block_us_median']:.1f} us")
    if args.out:
        Path(args.out).write_text(json.dumps({**provenance(), "passes": args.passes, "results": results}, indent=1))


if __name__ == "__main__":
    main()
