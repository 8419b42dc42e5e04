"""What kvbm's block identity costs on the TTFT path: hashing a new request's prompt.

    python benchmarks/block_identity.py [--tokens 20000] [--block-sizes 16,32] [--passes 15]
                                        [--new-tokens 1000] [--out benchmarks/results/block_identity_<host>.json]

A connector's scheduler role hashes a request's full blocks once, at its first lookup
(``BlockIdentity.update`` over the prompt), then one block at a time as it decodes. This
times the first (a fresh identity per pass, the token list as vLLM holds it: Python ints)
and the per-block increment, alternating block sizes within each pass; medians and minima.

Second turn: a conversation's next request of ``--tokens`` tokens, whose first
``--tokens - --new-tokens`` are the first turn's prompt and output (the first turn's identity
grew over both). Per pass and block size, alternating which goes first, it times the second
turn's first ``update`` with the scheduler's :class:`IdentityCache` (holding the first turn)
and without (a fresh identity); also a first turn through an empty cache (what the cache adds
on a miss) and decoding, per block over 64 blocks, with and without a cache. The keys of
both second turns are checked equal.

Writes one JSON file whose ``provenance`` is ``benchmarks/provenance.py``'s (commit, argv, machine).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from provenance import provenance  # noqa: E402  (benchmarks/, on the path as the script's folder)

from kvbm_client.hashing import BlockIdentity, IdentityCache, RequestExtras  # noqa: E402

EXTRAS = RequestExtras(cache_salt="tenant-a")


def namespace(block_size: int) -> str:
    return "meta-llama/Llama-3.1-8B-Instruct|torch.bfloat16|%d" % block_size


def time_prompt(tokens: list[int], block_size: int, cache: IdentityCache | None = None) -> float:
    identity = BlockIdentity(namespace(block_size), block_size, EXTRAS, cache)
    t0 = time.perf_counter()
    identity.update(tokens)
    return time.perf_counter() - t0


def time_decode_block(tokens: list[int], block_size: int) -> float:
    identity = BlockIdentity(namespace(block_size), block_size, EXTRAS)
    identity.update(tokens)
    grown = tokens + [7] * block_size
    t0 = time.perf_counter()
    identity.update(grown)
    return time.perf_counter() - t0


def time_decode_run(tokens: list[int], block_size: int, cache: IdentityCache | None, blocks: int) -> float:
    """Mean seconds per block over ``blocks`` blocks decoded one after another (as a request
    grows; a long-lived ``cache`` as the scheduler's, whose byte arrays grow in steps)."""
    identity = BlockIdentity(namespace(block_size), block_size, EXTRAS, cache)
    identity.update(tokens)
    grown, total = list(tokens), 0.0
    for _ in range(blocks):
        grown += [7] * block_size
        t0 = time.perf_counter()
        identity.update(grown)
        total += time.perf_counter() - t0
    return total / blocks


def time_second_turn(first: list[int], second: list[int], block_size: int, cached: bool) -> tuple[float, int, list]:
    """The second turn's hashing (seconds), the blocks it reused, its keys. The first turn's
    identity is built (and cached) before the clock starts."""
    cache = IdentityCache() if cached else None
    if cache is not None:
        BlockIdentity(namespace(block_size), block_size, EXTRAS, cache).update(first)
    identity = BlockIdentity(namespace(block_size), block_size, EXTRAS, cache)
    t0 = time.perf_counter()
    identity.update(second)
    return time.perf_counter() - t0, identity.reused, identity.keys


def ms(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values) * 1e3, 3), "min": round(min(values) * 1e3, 3)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=20_000)
    p.add_argument("--block-sizes", default="16,32")
    p.add_argument("--passes", type=int, default=15)
    p.add_argument("--new-tokens", type=int, default=1000,
                   help="second turn: tokens after the first turn's prompt and output")
    p.add_argument("--out", default="")
    args = p.parse_args()
    record: dict[str, Any] = {"provenance": provenance(), "passes": args.passes}
    rnd = random.Random(0)
    tokens = [rnd.randrange(0, 128_256) for _ in range(args.tokens)]
    first_turn = tokens[:args.tokens - args.new_tokens]  # the first turn's prompt and output
    sizes = [int(x) for x in args.block_sizes.split(",")]
    prompt: dict[int, list[float]] = {bs: [] for bs in sizes}
    decode: dict[int, list[float]] = {bs: [] for bs in sizes}
    miss: dict[int, list[float]] = {bs: [] for bs in sizes}
    run: dict[tuple[int, bool], list[float]] = {(bs, c): [] for bs in sizes for c in (False, True)}
    caches = {bs: IdentityCache() for bs in sizes}  # long-lived, as the scheduler's
    turn: dict[tuple[int, bool], list[float]] = {(bs, c): [] for bs in sizes for c in (False, True)}
    reused: dict[int, int] = {}
    for i in range(args.passes):
        for bs in sizes:  # alternate within a pass: drift on a shared machine hits every size alike
            prompt[bs].append(time_prompt(tokens, bs))
            miss[bs].append(time_prompt(tokens, bs, IdentityCache()))
            decode[bs].append(time_decode_block(tokens, bs))
            order = (False, True) if i % 2 == 0 else (True, False)  # alternate which goes first
            for c in order:
                run[(bs, c)].append(time_decode_run(tokens, bs, caches[bs] if c else None, 64))
            keys = {}
            for c in order:
                seconds, reused[bs], keys[c] = time_second_turn(first_turn, tokens, bs, c)
                turn[(bs, c)].append(seconds)
            assert keys[True] == keys[False], "the cache changed a key"
    results = [{"block_size": bs, "prompt_tokens": args.tokens, "blocks": args.tokens // bs,
                "prompt_ms_median": ms(prompt[bs])["median"], "prompt_ms_min": ms(prompt[bs])["min"],
                "decode_block_us_median": round(statistics.median(decode[bs]) * 1e6, 2),
                "cache_miss_prompt_ms": ms(miss[bs]),
                "decode_64_blocks_us_per_block_median": {"fresh": round(statistics.median(run[(bs, False)]) * 1e6, 2),
                                                          "cached": round(statistics.median(run[(bs, True)]) * 1e6, 2)}}
               for bs in sizes]
    second = [{"block_size": bs, "tokens": args.tokens, "first_turn_tokens": len(first_turn),
               "blocks": args.tokens // bs, "reused_blocks": reused[bs],
               "fresh_ms": ms(turn[(bs, False)]), "cached_ms": ms(turn[(bs, True)]),
               "speedup_median": round(statistics.median(turn[(bs, False)]) / statistics.median(turn[(bs, True)]), 2)}
              for bs in sizes]
    for r in results:
        print(f"block_size {r['block_size']:>3}: {r['prompt_tokens']}-token prompt ({r['blocks']} blocks) "
              f"{r['prompt_ms_median']:.3f} ms median ({r['prompt_ms_min']:.3f} min), through an empty cache "
              f"{r['cache_miss_prompt_ms']['median']:.3f} ms; one more block while decoding "
              f"{r['decode_block_us_median']:.1f} us; per block over 64: "
              f"{r['decode_64_blocks_us_per_block_median']['fresh']:.1f} us, "
              f"{r['decode_64_blocks_us_per_block_median']['cached']:.1f} us cached")
    for s in second:
        print(f"block_size {s['block_size']:>3}: second turn of {s['tokens']} tokens after {s['first_turn_tokens']}: "
              f"fresh {s['fresh_ms']['median']:.3f} ms, cached {s['cached_ms']['median']:.3f} ms median "
              f"({s['reused_blocks']} of {s['blocks']} blocks reused; {s['speedup_median']}x)")
    if args.out:
        record.update(results=results, second_turn=second)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
