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
KVBM_CONNECTOR_TRACE; with --logdir each engine's stdout (vLLM's own log lines) beside its
stderr; each engine runs in its own process group, and one that outlives
--timeout gets SIGABRT first (with PYTHONFAULTHANDLER=1 every process of it prints its
threads' stacks into --logdir) and then SIGKILL, so no leftover EngineCore holds the GPU.)

"ours": start the kvbm service first (it must outlive the engine processes) and set OURS_KTC to the
kv-transfer-config JSON that the README documents.
"""
import argparse, json, os, statistics, subprocess, sys, time

from peer_passes import quantile, run_passes, summarize, summary_line
from peer_systems import LAYER_HOOKS, SYSTEMS, base_system, system_kwargs
from peer_workload import cold_prompts, warmup_prompts, workload, write_model_config


def mode(args):
    return "graphs" if args.cuda_graphs else "eager"


def base_engine_kwargs(args):
    """The engine kwargs every system shares: eager, or (--cuda-graphs) vLLM's default compilation
    and CUDA graphs, PIECEWISE for a system in LAYER_HOOKS."""
    base = dict(model=args.model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                max_model_len=args.max_len, enforce_eager=not args.cuda_graphs, seed=0, max_num_seqs=8,
                kv_cache_memory_bytes=int(args.g1_gb * (1 << 30)))
    if args.cuda_graphs and base_system(args.system) in LAYER_HOOKS:
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
    try:  # LLM, or (--concurrent) AsyncLLM
        config = llm.vllm_config if hasattr(llm, "vllm_config") else llm.llm_engine.vllm_config
        return config.compilation_config.cudagraph_mode.name
    except AttributeError:
        return None


def engine(args):
    kw, _ = system_kwargs(args.system, args.g2_gb, args.pass_index)
    native = kw.pop("_native_size", None)
    base = base_engine_kwargs(args)
    t0 = time.time()
    if args.concurrent:
        import peer_concurrent as pc
        llm = pc.async_engine(base, kw, native)
        how = "kv_offloading_size" if native is not None else configured_by(kw)
        init_s = time.time() - t0
        turns = {}
        for r, u, prompt in workload(args.users, args.rounds, args.sys_len, args.ctx_len, args.turn_len):
            turns.setdefault(u, []).append((r, prompt))
        strangers = cold_prompts(args.ctx_len + args.sys_len)
        plan = concurrent_plan(args)
        rows = pc.run(llm, args.max_tokens, warmup_prompts(args), turns,
                      [next(strangers) for _ in range(args.strangers)], plan)
        return summarize_engine(args, how, init_s, llm, rows, {"concurrent": {**vars(plan), **pc.stats(rows)}})
    from vllm import LLM, SamplingParams
    llm = None
    if native is not None:  # prefer the documented engine flags, fall back to the connector config
        try:
            rest = {k: v for k, v in kw.items() if k != "kv_transfer_config"}  # (native_v1: async_scheduling)
            llm = LLM(**base, **rest, kv_offloading_size=native, kv_offloading_backend="native")
            how = "kv_offloading_size"
        except TypeError as e:
            print(json.dumps({"note": f"kv_offloading_size unsupported: {e}"}), flush=True)
    if llm is None:
        llm = LLM(**base, **kw)
        how = configured_by(kw)
    init_s = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, ignore_eos=True)
    for prompt in warmup_prompts(args):  # untimed
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    rows = []
    before = hit_counters(llm) if args.hit_sources else {}
    strangers = cold_prompts(args.ctx_len + args.sys_len)
    for r, u, prompt in workload(args.users, args.rounds, args.sys_len, args.ctx_len, args.turn_len):
        if args.cold_before_warm and r > 0:  # untimed: a new user's prompt, whose stores run meanwhile
            llm.generate([{"prompt_token_ids": next(strangers)}], sp, use_tqdm=False)
        t, wall = time.perf_counter(), time.time()
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        rows.append({"round": r, "user": u, "tokens": len(prompt), "ttft_s": time.perf_counter() - t, "t0": wall,
                     "cached": o.num_cached_tokens or 0, "output": list(o.outputs[0].token_ids)})
        if args.hit_sources:  # after the timing: reading the counters is not in the TTFT
            after = hit_counters(llm)
            rows[-1].update({k: after[k] - before[k] for k in after})
            before = after
    return summarize_engine(args, how, init_s, llm, rows, {})


def configured_by(kw):
    """How a system's engine kwargs configure its KV offloading (the result line's ``how``)."""
    return "kv_transfer_config" if "kv_transfer_config" in kw else "plain"


def concurrent_plan(args):
    """--concurrent's :class:`peer_concurrent.Plan` (ValueError: a negative value)."""
    from peer_concurrent import Plan
    return Plan(stagger_ms=args.stagger_ms, think_ms=args.think_ms, strangers=args.strangers,
                stranger_gap_ms=args.stranger_gap_ms)


def summarize_engine(args, how, init_s, llm, rows, extra):
    """Print the engine's result line: warm (a user's later turns) and cold (its first) TTFT."""
    users = [x for x in rows if x.get("kind", "user") == "user"]
    warm = [x["ttft_s"] for x in users if x["round"] > 0]
    cold = [x["ttft_s"] for x in users if x["round"] == 0]
    print(json.dumps({"system": args.system, "how": how, "init_s": round(init_s, 1), "mode": mode(args),
                      "warmup_turn": args.warmup_turn,
                      "cudagraph_mode": resolved_cudagraph_mode(llm),
                      "warm_ttft_p50": round(statistics.median(warm), 4),
                      "warm_ttft_p90": round(quantile(warm, 0.9), 4),
                      "warm_ttft_mean": round(statistics.mean(warm), 4),
                      "cold_ttft_mean": round(statistics.mean(cold), 4),
                      "warm_cached_frac": round(sum(x["cached"] for x in users if x["round"] > 0) /
                                                max(1, sum(x["tokens"] for x in users if x["round"] > 0)), 3),
                      **hit_fractions(users), **extra, "rows": rows}), flush=True)


def hit_fractions(rows):
    """Warm rounds' shares of prompt tokens from vLLM's G1 and from the connector (--hit-sources)."""
    warm = [x for x in rows if x["round"] > 0 and "g1_hit_tokens" in x]
    if not warm:
        return {}
    if sum(x["g1_hit_tokens"] + x["external_hit_tokens"] for x in warm) < sum(x["cached"] for x in warm):
        # vLLM's counters missed hits the outputs report (vLLM 0.26: kvbm's, the native and Dynamo's
        # connectors alike, in one run; LMCache's engine counted them):
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
    ap.add_argument("--cold-before-warm", action="store_true",
                    help="before each warm request, an untimed cold one of --sys-len + --ctx-len new tokens: a "
                         "connector that stores after a request returns stores it while the warm one loads "
                         "(mind G2: each adds its blocks)")
    ap.add_argument("--concurrent", action="store_true",
                    help="overlapping requests (peer_concurrent.py): every user its own task on vLLM's AsyncLLM, "
                         "--stagger-ms apart, thinking ~--think-ms between turns; --strangers new prompts arrive "
                         "meanwhile. Mind G1: several long prompts at once need room")
    ap.add_argument("--stagger-ms", type=float, default=50.0, help="--concurrent: user u starts u x this late")
    ap.add_argument("--think-ms", type=float, default=100.0,
                    help="--concurrent: mean of a user's exponential pause between its turns")
    ap.add_argument("--strangers", type=int, default=0,
                    help="--concurrent: this many new prompts of --sys-len + --ctx-len tokens, one every "
                         "--stranger-gap-ms (cold prefills whose stores run beside the users' loads)")
    ap.add_argument("--stranger-gap-ms", type=float, default=300.0)
    ap.add_argument("--passes", type=int, default=1,
                    help="run the systems this many times, in order and in reverse by turns (A B C C B A ...), "
                         "a fresh engine each")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="vLLM's default compilation and CUDA graphs instead of enforce_eager")
    ap.add_argument("--out", default="")
    ap.add_argument("--logdir", default="", help="keep each engine's stderr here")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, for a smoke test on a CPU build")
    ap.add_argument("--warmup-turn", action="store_true",
                    help="before the timed rounds, one untimed user of the same lengths takes two turns (its "
                         "second finds its first in the engine's own cache): the engine meets a warm turn's "
                         "shapes (a few new tokens after a long prefix) for the first time there, not in the "
                         "first timed warm request (whose forward then took 1.5-2x the CPU of the later "
                         "ones, every system alike, H100 2026-11-27)")
    ap.add_argument("--hit-sources", action="store_true",
                    help="vLLM's stats on: every row records the prompt tokens found in vLLM's own GPU prefix "
                         "cache (g1_hit_tokens) and those the connector provided (external_hit_tokens), read "
                         "after each request; every line their warm shares (warm_g1_frac, warm_external_frac)")
    args = ap.parse_args(argv)
    if args.passes < 1:
        ap.error(f"--passes must be at least 1, not {args.passes}")
    if args.concurrent and (args.cold_before_warm or args.hit_sources):
        ap.error("--concurrent takes --strangers, not --cold-before-warm; and not --hit-sources (vLLM's counters "
                 "would mix overlapping requests)")
    try:
        concurrent_plan(args)  # (its checks, before any engine ran)
    except ValueError as e:  # Plan's "<field> must be ...": named as its flag
        field, rest = str(e).split(" ", 1)
        ap.error(f"--{field.replace('_', '-')} {rest}")
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
           "--max-tokens", str(args.max_tokens)] + (["--cold-before-warm"] if args.cold_before_warm else [])
    return (cmd + (["--cuda-graphs"] if args.cuda_graphs else []) + (["--hit-sources"] if args.hit_sources else [])
            + (["--warmup-turn"] if args.warmup_turn else [])
            + (["--concurrent", "--stagger-ms", str(args.stagger_ms), "--think-ms", str(args.think_ms), "--strangers",
                str(args.strangers), "--stranger-gap-ms", str(args.stranger_gap_ms)] if args.concurrent else []))


#: how the engine process's result line (``engine``'s one JSON print) starts
RESULT_LINE = '{"system"'


def run_engine(name, pass_index, args):
    """Run one system in its own engine process and return its result line (the seam that
    ``peer_passes.run_passes`` calls; without ``"rows"`` where the engine failed)."""
    _, env = system_kwargs(name, args.g2_gb, pass_index)
    t = time.time()
    p = subprocess.Popen(engine_cmd(name, pass_index, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, **env}, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=args.timeout)
        lines = [l for l in stdout.splitlines() if l.startswith(RESULT_LINE)]
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
        # vLLM logs to stdout by default: its lines (not the result line) go beside the stderr
        logged = "\n".join(l for l in (stdout or "").splitlines() if not l.startswith(RESULT_LINE)) + "\n"
        for stream, text in (("stderr", stderr), ("stdout", logged)):
            with open(os.path.join(args.logdir, f"{name}.{stream}.log"), "a") as f:
                f.write(f"===== pass {pass_index} =====\n{text}")
    res["wall_s"] = round(time.time() - t, 1)
    return res


def main(argv=None, run_one=None):
    """The harness; ``run_one(system, pass_index) -> result`` replaces the engine processes (tests)."""
    args = parse_args(argv)
    if args.engine:
        return engine(args)
    write_model_config(args.model, args.tiny)

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
