"""Side-by-side TTFT of KV-offloading systems on the real vLLM engine (GPU), in one harness run.

Each system runs in its own process on the same workload: N users with a shared system prompt and a
long private context, several rounds; G1 (the engine's KV cache) holds only a fraction of the working
set, so between a user's turns its blocks are evicted from the GPU. TTFT of a request ~ latency of
generate(max_tokens=1). Cold round 0 is reported apart from the warm rounds.

  python3 vllm_peers.py --systems baseline,native,lmcache,dynamo,ours --out results.jsonl [--passes 2] [--cuda-graphs]

--passes N runs the systems N times, in order and in reverse by turns (A B C C B A ...), a fresh
engine each time, and ends
with one summary per system: the median over the passes of each pass's warm p50 / p90, each pass's
value, and "did not reproduce" where the passes differ by more than 10 % (``peer_passes.py``).
Every result line carries its ``pass``; ``--passes 1`` (the default) is the single run of before.
--cuda-graphs runs every engine with vLLM's default compilation and CUDA graphs instead of eager
(``mode`` in every line; ``cudagraph_mode`` is what the engine resolved), PIECEWISE for a connector
whose layer hooks do work (``LAYER_HOOKS``).

(Copied from ../shared/tools/vllm_peers.py; additions: --max-tokens and the output token ids in
each row, for the greedy-equality check; each row's start time, to line up with
KVBM_CONNECTOR_TRACE; each engine runs in its own process group, and one that outlives
--timeout gets SIGABRT first (with PYTHONFAULTHANDLER=1 every process of it prints its
threads' stacks into --logdir) and then SIGKILL, so no leftover EngineCore holds the GPU.)

"ours": start the kvbm service first (it must outlive the engine processes) and set OURS_KTC to the
kv-transfer-config JSON that the README documents.
"""
import argparse, json, os, statistics, subprocess, sys, time

from peer_passes import run_passes, summarize, summary_line

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
}


def workload(users, rounds, sys_len, ctx_len, turn_len, seed=11):
    import random
    rnd = random.Random(seed)
    tok = lambda n: [rnd.randrange(100, 150000) for _ in range(n)]
    system = tok(sys_len)
    hist = {u: system + tok(ctx_len) for u in range(users)}
    out = []
    for r in range(rounds):
        for u in range(users):
            hist[u] = hist[u] + tok(turn_len)
            out.append((r, u, list(hist[u])))
            hist[u] = hist[u] + tok(32)
    return out


#: systems whose connector does work in vLLM's per-layer hooks (wait_for_layer_load / save_kv_layer)
#: without declaring requires_piecewise_for_cudagraph (vLLM 0.26 then keeps FULL graphs, whose
#: replays skip the hooks): under --cuda-graphs they get PIECEWISE graphs. Dynamo KVBM 1.6.1's
#: save_kv_layer records a CUDA event per layer; the native connector's hooks are no-ops, kvbm's
#: wait only under load_mode layerwise ("ours_layerwise"), which declares PIECEWISE itself, as
#: LMCache does when it is layerwise (not here).
LAYER_HOOKS = ("dynamo",)
#: kvbm's variants: the connector's kv_connector_extra_config over its defaults ("ours": load_mode
#: auto, early loads on where safe); ours_layerwise_noearly: the worker role starts every load (A/B);
#: ours_layerwise_cpuwait: the forward's layer waits on the CPU, as before GPU layer waits (A/B);
#: ours_layerwise_gpuwait: the layer waits on the GPU whatever CUDA's module loading (lazy here;
#: gpu_layer_waits true) (A/B); ours_layerwise_eager: gpu_layer_waits "eager", the default until
#: 2026-11-26 (tenth session), which keeps them on the CPU under lazy loading (A/B);
#: ours_layerwise_tail: only the last layers' waits on the GPU (gpu_layer_waits tail, the default
#: since then: the same as ours_layerwise, kept so that older runbook steps still run);
#: ours_layerwise_g4 / _g3: layer-pipelined loads in 4 / 3 layer groups instead of 6 (A/B);
#: ours_layerwise_syncstore: each step's PrepareStore on vLLM's scheduler thread, its stores
#: shipped with that step (async_store_plans false: the behaviour until 2026-11-26's eleventh session) (A/B);
#: ours_layerwise_perlayer: vLLM's per-layer KV tensors instead of one cross-layer buffer (A/B)
#: ours_layerwise_nofilter: every lookup asks the leader, as before the twelfth session's presence
#: filter (presence_filter false) (A/B)
OURS = {"ours": {}, "ours_sync": {"load_mode": "sync"}, "ours_async": {"load_mode": "async"},
        "ours_layerwise": {"load_mode": "layerwise"},
        "ours_layerwise_noearly": {"load_mode": "layerwise", "early_loads": False},
        "ours_layerwise_cpuwait": {"load_mode": "layerwise", "gpu_layer_waits": False},
        "ours_layerwise_gpuwait": {"load_mode": "layerwise", "gpu_layer_waits": True},
        "ours_layerwise_tail": {"load_mode": "layerwise", "gpu_layer_waits": "tail"},
        "ours_layerwise_eager": {"load_mode": "layerwise", "gpu_layer_waits": "eager"},
        "ours_layerwise_g4": {"load_mode": "layerwise", "layer_groups": 4},
        "ours_layerwise_g3": {"load_mode": "layerwise", "layer_groups": 3},
        "ours_layerwise_syncstore": {"load_mode": "layerwise", "async_store_plans": False},
        "ours_layerwise_perlayer": {"load_mode": "layerwise", "cross_layer_blocks": False},
        "ours_layerwise_nofilter": {"load_mode": "layerwise", "presence_filter": False}}
SYSTEMS = ("recompute", "baseline", "null", "native", "lmcache", "lmcache_timed", "dynamo", *OURS)


def system_kwargs(name, g2_gb, pass_index=0):
    """Engine kwargs and env for one system, in pass ``pass_index``."""
    env = {}
    kw = {}
    if name == "recompute":
        kw["enable_prefix_caching"] = False
    elif name == "baseline":
        pass
    elif name == "native":
        kw["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"cpu_bytes_to_use": int(g2_gb * (1 << 30)),
                                                                  "num_cpu_blocks": None}}
        kw["_native_size"] = g2_gb
    elif name in ("lmcache", "lmcache_timed"):
        # lmcache_timed: the same connector, its hooks timed into the connector trace (peer_timing.py)
        kw["kv_transfer_config"] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"} \
            if name == "lmcache" else {"kv_connector": "TimedLMCacheConnectorV1", "kv_role": "kv_both",
                                       "kv_connector_module_path": "benchmarks.peer_timing"}
        env.update(LMCACHE_LOCAL_CPU="True", LMCACHE_MAX_LOCAL_CPU_SIZE=str(g2_gb), LMCACHE_CHUNK_SIZE="256",
                   LMCACHE_USE_EXPERIMENTAL="True")
    elif name == "null":
        # a connector that does nothing (null_connector.py): vLLM's own cost of running one
        kw["kv_transfer_config"] = {"kv_connector": "NullConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "benchmarks.null_connector"}
    elif name == "dynamo":
        kw["kv_transfer_config"] = {"kv_connector": "DynamoConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "kvbm.vllm_integration.connector"}
        env.update(DYN_KVBM_CPU_CACHE_GB=str(g2_gb), DYN_KVBM_METRICS="false")
    elif name in OURS:
        # ours: the connector's defaults (load_mode auto: async under vLLM's V2 runner or async
        # scheduling); the others: the same with the settings of OURS[name]
        kw["kv_transfer_config"] = json.loads(os.environ["OURS_KTC"])
        if name != "ours":
            # its own key namespace: the same service, but none of the "ours" run's blocks
            kw["kv_transfer_config"].setdefault("kv_connector_extra_config", {}).update(OURS[name], namespace=name)
        if pass_index > 0:
            # the kvbm service outlives the passes: a namespace per pass, so that every pass starts
            # without the blocks of the one before, like the peers' in-process caches
            extra = kw["kv_transfer_config"].setdefault("kv_connector_extra_config", {})
            extra["namespace"] = f"{extra.get('namespace') or name}_pass{pass_index}"
        env.update(DYN_KVBM_CPU_CACHE_GB=str(g2_gb))
        # KVBM_EAGER=1 starts kvbm's engines with eager module loading (gpu_layer_waits "eager"
        # puts the layer waits on the GPU only then; ours_layerwise_gpuwait does under lazy
        # loading too). NOTE: vLLM 0.26 then did not start within 300 s on the H200 (2026-11-26)
        if os.environ.get("KVBM_EAGER") == "1":
            env.update(CUDA_MODULE_LOADING="EAGER")
    else:
        raise SystemExit(f"unknown system {name}")
    return kw, env


def mode(args):
    return "graphs" if args.cuda_graphs else "eager"


def base_engine_kwargs(args):
    """The engine kwargs every system shares: eager, or (--cuda-graphs) vLLM's default compilation
    and CUDA graphs, PIECEWISE for a system in LAYER_HOOKS."""
    base = dict(model=args.model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                max_model_len=args.max_len, enforce_eager=not args.cuda_graphs, seed=0, max_num_seqs=8,
                kv_cache_memory_bytes=int(args.g1_gb * (1 << 30)))
    if args.cuda_graphs and args.system in LAYER_HOOKS:
        base["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    if args.hit_sources:
        base["disable_log_stats"] = False  # vLLM's counters, read after every request (hit_counters)
    return base


HIT_COUNTERS = {"vllm:prefix_cache_hits": "g1_hit_tokens", "vllm:external_prefix_cache_hits": "external_hit_tokens"}


def hit_counters(llm):
    """vLLM's running totals of prompt tokens found in its own GPU prefix cache (G1) and those a
    KV connector provided (--hit-sources; the native offloading connector counts as external)."""
    got = dict.fromkeys(HIT_COUNTERS.values(), 0)
    for m in llm.get_metrics():
        if m.name in HIT_COUNTERS:
            got[HIT_COUNTERS[m.name]] += int(getattr(m, "value", 0))
    return got


def resolved_cudagraph_mode(llm):
    """The CUDA graph mode the engine settled on (vLLM may override what was asked)."""
    try:
        return llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name
    except AttributeError:
        return None


def engine(args):
    from vllm import LLM, SamplingParams
    kw, _ = system_kwargs(args.system, args.g2_gb, args.pass_index)
    native = kw.pop("_native_size", None)
    base = base_engine_kwargs(args)
    t0 = time.time()
    llm = None
    if native is not None:  # prefer the documented engine flags, fall back to the connector config
        try:
            llm = LLM(**base, kv_offloading_size=native, kv_offloading_backend="native")
            how = "kv_offloading_size"
        except TypeError as e:
            print(json.dumps({"note": f"kv_offloading_size unsupported: {e}"}), flush=True)
    if llm is None:
        llm = LLM(**base, **kw)
        how = "kv_transfer_config" if "kv_transfer_config" in kw else "plain"
    init_s = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, ignore_eos=True)
    # warm the kernels on a throwaway prompt
    llm.generate([{"prompt_token_ids": list(range(1000, 1600))}], sp, use_tqdm=False)
    rows = []
    before = hit_counters(llm) if args.hit_sources else {}
    for r, u, prompt in workload(args.users, args.rounds, args.sys_len, args.ctx_len, args.turn_len):
        t, wall = time.perf_counter(), time.time()
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        rows.append({"round": r, "user": u, "tokens": len(prompt), "ttft_s": time.perf_counter() - t, "t0": wall,
                     "cached": o.num_cached_tokens or 0, "output": list(o.outputs[0].token_ids)})
        if args.hit_sources:  # after the timing: reading the counters is not in the TTFT
            after = hit_counters(llm)
            rows[-1].update({k: after[k] - before[k] for k in after})
            before = after
    warm = [x["ttft_s"] for x in rows if x["round"] > 0]
    cold = [x["ttft_s"] for x in rows if x["round"] == 0]
    q = lambda v, p: sorted(v)[min(len(v) - 1, int(p * len(v)))]
    print(json.dumps({"system": args.system, "how": how, "init_s": round(init_s, 1), "mode": mode(args),
                      "cudagraph_mode": resolved_cudagraph_mode(llm),
                      "warm_ttft_p50": round(statistics.median(warm), 4), "warm_ttft_p90": round(q(warm, 0.9), 4),
                      "warm_ttft_mean": round(statistics.mean(warm), 4),
                      "cold_ttft_mean": round(statistics.mean(cold), 4),
                      "warm_cached_frac": round(sum(x["cached"] for x in rows if x["round"] > 0) /
                                                max(1, sum(x["tokens"] for x in rows if x["round"] > 0)), 3),
                      **hit_fractions(rows), "rows": rows}), flush=True)


def hit_fractions(rows):
    """Warm rounds' shares of prompt tokens from vLLM's G1 and from the connector (--hit-sources)."""
    warm = [x for x in rows if x["round"] > 0 and "g1_hit_tokens" in x]
    if not warm:
        return {}
    if sum(x["g1_hit_tokens"] + x["external_hit_tokens"] for x in warm) < sum(x["cached"] for x in warm):
        # vLLM's counters missed hits the outputs report (seen with kvbm's connector on vLLM 0.26):
        # not measured, rather than a share of 0
        return {"warm_g1_frac": None, "warm_external_frac": None}
    total = max(1, sum(x["tokens"] for x in warm))
    return {"warm_g1_frac": round(sum(x["g1_hit_tokens"] for x in warm) / total, 3),
            "warm_external_frac": round(sum(x["external_hit_tokens"] for x in warm) / total, 3)}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/qwen3-4b-shape")
    ap.add_argument("--systems", default="recompute,baseline,native,lmcache,dynamo")
    ap.add_argument("--system")
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--pass-index", type=int, default=0, help=argparse.SUPPRESS)  # set for --engine
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sys-len", type=int, default=1024)
    ap.add_argument("--ctx-len", type=int, default=6144)
    ap.add_argument("--turn-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--g1-gb", type=float, default=3.0)
    ap.add_argument("--g2-gb", type=float, default=24.0)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per engine (one system, one pass)")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--passes", type=int, default=1,
                    help="run the systems this many times, in order and in reverse by turns (A B C C B A ...), "
                         "a fresh engine each")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="vLLM's default compilation and CUDA graphs instead of enforce_eager")
    ap.add_argument("--out", default="")
    ap.add_argument("--logdir", default="", help="keep each engine's stderr here")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, for a smoke test on a CPU build")
    ap.add_argument("--hit-sources", action="store_true",
                    help="vLLM's stats on: every row records the prompt tokens found in vLLM's own GPU prefix "
                         "cache (g1_hit_tokens) and those the connector provided (external_hit_tokens), read "
                         "after each request; every line their warm shares (warm_g1_frac, warm_external_frac)")
    args = ap.parse_args(argv)
    if args.passes < 1:
        ap.error(f"--passes must be at least 1, not {args.passes}")
    unknown = [n for n in ([args.system] if args.engine else args.systems.split(",")) if n not in SYSTEMS]
    if unknown:  # before any engine ran, not after an hour of them
        ap.error(f"unknown system(s) {unknown}: one of {', '.join(SYSTEMS)}")
    return args


def engine_cmd(name, pass_index, args):
    """The command line of one engine process: system ``name`` in pass ``pass_index``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--engine", "--system", name, "--pass-index", str(pass_index),
           "--model", args.model, "--users", str(args.users), "--rounds", str(args.rounds),
           "--sys-len", str(args.sys_len), "--ctx-len", str(args.ctx_len), "--turn-len", str(args.turn_len),
           "--max-len", str(args.max_len), "--g1-gb", str(args.g1_gb), "--g2-gb", str(args.g2_gb),
           "--max-tokens", str(args.max_tokens)]
    return cmd + (["--cuda-graphs"] if args.cuda_graphs else []) + (["--hit-sources"] if args.hit_sources else [])


def run_engine(name, pass_index, args):
    """Run one system in its own engine process and return its result line (the seam that
    ``peer_passes.run_passes`` calls; without ``"rows"`` where the engine failed)."""
    _, env = system_kwargs(name, args.g2_gb, pass_index)
    t = time.time()
    p = subprocess.Popen(engine_cmd(name, pass_index, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, **env}, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=args.timeout)
        lines = [l for l in stdout.splitlines() if l.startswith('{"system"')]
        res = json.loads(lines[-1]) if lines else {"system": name, "error": (stderr or stdout)[-1500:]}
    except subprocess.TimeoutExpired:
        import signal
        tree = [p.pid] + descendants(p.pid)  # vLLM's EngineCore may leave our process group
        for sig in (signal.SIGABRT, signal.SIGKILL):  # stacks first (faulthandler), then sure
            for pid in tree:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            time.sleep(3)
        stdout, stderr = p.communicate()
        res = {"system": name, "error": f"timeout after {args.timeout}s: " + stderr[-800:]}
    if args.logdir:
        with open(os.path.join(args.logdir, f"{name}.stderr.log"), "a") as f:
            f.write(f"===== pass {pass_index} =====\n{stderr}")
    res["wall_s"] = round(time.time() - t, 1)
    return res


def main(argv=None, run_one=None):
    """The harness; ``run_one(system, pass_index) -> result`` replaces the engine processes (tests)."""
    args = parse_args(argv)
    if args.engine:
        return engine(args)
    os.makedirs(args.model, exist_ok=True)
    cfg = dict(QWEN3_4B)
    if args.tiny:
        cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=152000)
    with open(os.path.join(args.model, "config.json"), "w") as f:
        json.dump(cfg, f)

    def write(line):
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")

    # one provenance line per harness run (commit, argv, machine with its GPUs); ttft_breakdown.py
    # reads the lines with "rows" and the summaries
    if args.out:
        from provenance import provenance
        write({"provenance": provenance(argv), "mode": mode(args), "passes": args.passes})

    def one(name, pass_index):
        res = run_one(name, pass_index) if run_one else run_engine(name, pass_index, args)
        res.setdefault("mode", mode(args))  # also on a failed engine's line
        return res

    def emit(res):
        print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
        write(res)

    results = run_passes(args.systems.split(","), args.passes, one, emit)
    if args.passes > 1:  # one pass: the lines above are the whole result, as before --passes
        print(f"\nwarm TTFT over {args.passes} passes ({mode(args)}):", flush=True)
        for s in summarize(results):
            print(summary_line(s), flush=True)
            write({**s, "mode": mode(args)})
    return results


if __name__ == "__main__":
    main()
