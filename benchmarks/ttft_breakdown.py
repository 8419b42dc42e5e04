"""Where a warm request's TTFT goes with kvbm, from one harness run (``vllm_peers.py`` JSONL) and
the connector's trace of the same run (``KVBM_CONNECTOR_TRACE``); plus the peers' table.

    python3 benchmarks/ttft_breakdown.py RESULTS.jsonl TRACE.jsonl [--systems ours,ours_sync,ours_async,ours_layerwise,ours_layerwise_noearly,ours_layerwise_cpuwait] [--pass N]

Passes (``vllm_peers.py --passes N``): by default every pass is used; the table gives per system
the median over the passes of each pass's warm p50 / p90 (each pass's p50 beside it, and whether
the passes reproduced), and the breakdown pools the warm requests of all passes. ``--pass N``:
that pass alone. A file from before passes is one pass (pass 0).

Each engine ran in its own process: the trace's process of a run is the one with the most events
within the run's requests (their ``t0`` to the last one's end). Per warm request (round > 0), from
the row's start time ``t0``:
  front      t0 -> the scheduler role asks the leader (vLLM front end, request hashing, queue)
  lookup     PrepareLoad round trip (match + count + pin at the leader)
  to_copy    PrepareLoad answered -> the copy is sent to the worker daemon (vLLM allocation; with
             early loads the scheduler role sends it at the end of the step's scheduling, else the
             worker role does, after the step's PrepareStore and input preparation)
  head_start the copy sent early -> the worker role asks for it (0 without early loads)
  wait       the worker role's Transfer submitted -> answered (what the engine's thread waits,
             except for layer-pipelined loads: their forward runs beside the copy)
  after_load load done -> the request finished in the scheduler (forward, sampling, output)
  ret        finished -> generate() returned
  (front + lookup + to_copy + head_start + wait + after_load + ret = ttft)
  store_prep PrepareStore round trip of the step (inside to_copy or head_start)
  alloc      PrepareLoad answered -> vLLM allocated the blocks (inside to_copy; traces from
             before the "allocated" event: nan)
  copy       the copy on the daemon's lane, from its answer (it starts at the end of to_copy)
  layer_wait layer-pipelined loads (``ours_layerwise``): what the engine's thread waited in the
             layer hooks of the step (the rest of ``wait`` overlapped the forward)
  first_group  layer-pipelined loads: the first layer group landed, ms after the worker role's call
  last_group   layer-pipelined loads: the last layer group landed, ms after the worker role's call
  settle     layer-pipelined loads: once the forward was enqueued, the wait for the daemon's answer
             (traces from 2026-11-26 seventh session on)
  lmcache_timed (peer_timing.py): front (to LMCache's lookup), lookup, to_load (lookup ->
             start_load_kv), load (start_load_kv: LMCache issuing its copy, which may still run
             after it returned; load_cpu its CPU), forward / forward_cpu (start_load_kv ->
             wait_for_save), after (-> the first token), load_start (t0 -> start_load_kv)
  forward    the engine's thread from the step's loads sent (synchronous: answered) to its
             ``wait_for_save`` (the forward enqueued, then ``settle``); forward_cpu: that thread's
             CPU time meanwhile (less than ``forward``: it waited for a layer, the daemon's answer,
             the interpreter lock or a CPU)
  copy_start t0 -> the copy sent to the worker daemon (front + lookup + to_copy)
  landed     layer-pipelined loads: t0 -> the last layer group landed (copy_start + head_start +
             last_group); against front + one memcpy of the hit, what the copy lost to the lookup
             and the link
  tail       layer-pipelined loads: the last layer group landed -> the first token (ttft - landed:
             the forward's last layers, sampling, output)
  gpu_waits  layer-pipelined loads: the layer waits enqueued on the GPU (0: all on the CPU)
  gc         the engine process's garbage collections of 2 ms or more while the request was
             served, summed (traces from 2026-11-27 sixteenth session on; before: nan)
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable, Iterator

from peer_passes import slots, summarize, summary_line
from peer_systems import base_system

#: systems that are no peer to beat: vLLM alone, vLLM recomputing, vLLM with a connector that does nothing
NOT_PEERS = ("baseline", "recompute", "null")
#: the peers' systems whose hooks are traced (``peer_timing.py``, ``null_connector.py``)
TRACED_PEERS = ("lmcache_timed", "null")
FIELDS = ("ttft", "front", "lookup", "to_copy", "head_start", "wait", "after_load", "ret", "store_prep", "alloc",
          "copy", "layer_wait", "first_group", "last_group", "settle", "forward",
          "forward_cpu", "copy_start", "landed", "tail", "gpu_waits", "gc", "blocks")


def load_runs(path: str, pass_index: int | None = None) -> list[dict]:
    """The engine runs of a result file, each with its ``pass`` (0 in a file from before passes)
    and ``slot`` (``ours#2`` for the second ``ours`` of a pass); only pass ``pass_index`` where
    given. A failed run has no ``"rows"`` (and counts as a failed pass)."""
    runs: list[dict] = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if "system" in d and "summary" not in d:
                d.setdefault("pass", 0)
                runs.append(d)
    for p in {r["pass"] for r in runs}:  # slot labels of a file written before they were recorded
        mine = [r for r in runs if r["pass"] == p]
        for r, label in zip(mine, slots([r["system"] for r in mine])):
            r.setdefault("slot", label)
    return [r for r in runs if pass_index is None or r["pass"] == pass_index]


def trace_pid(run: dict, events: list[dict]) -> int | None:
    """The process of ``events`` that traced ``run``: the most events within its requests."""
    t0 = min(r["t0"] for r in run["rows"])
    t1 = max(r["t0"] + r["ttft_s"] for r in run["rows"]) + 0.002
    counts: dict[int, int] = {}
    for e in events:
        if t0 <= e["t"] <= t1:
            counts[e["pid"]] = counts.get(e["pid"], 0) + 1
    return max(counts, key=lambda pid: counts[pid]) if counts else None


def warm_requests(rows: list[dict], events: list[dict]
                  ) -> Iterator[tuple[dict, float, float, Callable[[str], list[dict]]]]:
    """Each warm request (a round after the first): its row, when it was sent and answered, and
    ``pick(what)``: its ``what`` events (those traced while it was served)."""
    for r in rows:
        if r["round"] == 0:
            continue
        t0, t1 = r["t0"], r["t0"] + r["ttft_s"]
        mine = [e for e in events if t0 <= e["t"] <= t1 + 0.002]
        yield r, t0, t1, lambda what, mine=mine: [e for e in mine if e["what"] == what]


def breakdown(rows: list[dict], events: list[dict]) -> list[dict]:
    out = []
    traced_gc = any(e["what"] in ("gc", "gc_watch") for e in events)
    for r, t0, t1, pick in warm_requests(rows, events):
        lookups, loads, finished = pick("prepare_load"), pick("load"), pick("finished")
        if not (lookups and loads and finished):
            continue
        p, ld, f = lookups[-1], loads[0], finished[-1]
        load_start = ld["t"] - ld["submit_to_done_ms"] / 1e3
        early = [e for e in pick("early_load") if e["req"] == ld["req"]]
        copy_start = early[0]["t"] if early else load_start
        alloc = [e for e in pick("allocated") if e["req"] == ld["req"]]
        last_group = (ld.get("landed_ms") or [float("nan")])[-1]
        landed = (load_start - t0) * 1e3 + last_group
        out.append({"ttft": r["ttft_s"] * 1e3, "front": (p["t"] - p["ms"] / 1e3 - t0) * 1e3, "lookup": p["ms"],
                    "to_copy": (copy_start - p["t"]) * 1e3, "head_start": (load_start - copy_start) * 1e3,
                    "wait": ld["submit_to_done_ms"], "after_load": (f["t"] - ld["t"]) * 1e3,
                    "ret": (t1 - f["t"]) * 1e3, "store_prep": sum(e["ms"] for e in pick("prepare_store")),
                    "alloc": (alloc[0]["t"] - p["t"]) * 1e3 if alloc else float("nan"),
                    "copy": ld.get("copy_ms", float("nan")),
                    "layer_wait": sum(e["waited_ms"] for e in pick("layer_waits")) if pick("layer_waits") else float("nan"),
                    "first_group": (ld.get("landed_ms") or [float("nan")])[0],
                    "last_group": last_group,
                    "settle": sum(e.get("settle_ms", float("nan")) for e in pick("layer_waits"))
                    if pick("layer_waits") else float("nan"),
                    "forward": pick("forward")[-1]["ms"] if pick("forward") else float("nan"),
                    "forward_cpu": pick("forward")[-1]["cpu_ms"] if pick("forward") else float("nan"),
                    "copy_start": (copy_start - t0) * 1e3, "landed": landed, "tail": r["ttft_s"] * 1e3 - landed,
                    "gpu_waits": ld.get("gpu_waits", float("nan")),
                    "gc": sum(e["ms"] for e in pick("gc")) if traced_gc else float("nan"),
                    "blocks": ld["blocks"]})
    return out


PEER_FIELDS = ("ttft", "front", "lookup", "to_load", "load", "load_cpu", "forward", "forward_cpu", "after",
               "load_start")


def peer_breakdown(rows: list[dict], events: list[dict]) -> list[dict]:
    """``lmcache_timed`` (``peer_timing.py``): per warm request, vLLM's front end to the peer's
    lookup, the lookup, lookup -> ``start_load_kv``, the load in it (wall and CPU), the forward
    after it (wall and CPU) and the rest of the request."""
    out = []
    for r, t0, t1, pick in warm_requests(rows, events):
        lookups, loads = pick("peer_lookup"), pick("peer_load")
        if not (lookups and loads):
            continue
        ld = max(loads, key=lambda e: e["ms"])
        fwd = [e for e in pick("peer_forward") if e["t"] >= ld["t"]]
        first = lookups[0]
        out.append({"ttft": r["ttft_s"] * 1e3, "front": (first["t"] - first["ms"] / 1e3 - t0) * 1e3,
                    "lookup": sum(e["ms"] for e in lookups),
                    "to_load": (ld["t"] - ld["ms"] / 1e3 - lookups[-1]["t"]) * 1e3,
                    "load": ld["ms"], "load_cpu": ld["cpu_ms"],
                    "forward": fwd[0]["ms"] if fwd else float("nan"),
                    "forward_cpu": fwd[0]["cpu_ms"] if fwd else float("nan"),
                    "after": (t1 - fwd[0]["t"]) * 1e3 if fwd else float("nan"),
                    "load_start": (ld["t"] - ld["ms"] / 1e3 - t0) * 1e3})
    return out


def table(runs: list[dict]) -> None:
    """Per slot: the median over its passes of the warm p50 / p90 (one pass: that pass's)."""
    sums = summarize(runs)
    several = any(len(s["passes"]) > 1 for s in sums)
    print(f"{'system':<11} {'p50 ms':>7} {'p90 ms':>7} {'from cache':>10}  ratio to the best peer"
          + ("  (medians over the passes)" if several else ""))
    peers = [s for s in sums if base_system(s["system"]) not in NOT_PEERS and not s["system"].startswith("ours")]
    best = min((s["warm_ttft_p50_median"] for s in peers if s["warm_ttft_p50_median"] is not None), default=None)
    for s in sums:
        if s["warm_ttft_p50_median"] is None:
            print(f"{s['summary']:<11} failed in every pass")
            continue
        cached = statistics.median(r["warm_cached_frac"] for r in runs if r["slot"] == s["summary"] and "rows" in r)
        ratio = f"{s['warm_ttft_p50_median'] / best:.2f}x" if best else "-"
        print(f"{s['summary']:<11} {s['warm_ttft_p50_median'] * 1e3:7.1f} {s['warm_ttft_p90_median'] * 1e3:7.1f} "
              f"{cached * 100:9.1f}%  {ratio}")
    cold_table(runs)
    if several:
        print("\nper pass:")
        for s in sums:
            print(summary_line(s))


def cold_table(runs: list[dict]) -> None:
    """Cold TTFT (the mean of round 0 per pass, the median over the passes) beside vLLM alone
    (``baseline``) where it ran: the cold target's numbers."""
    cold: dict[str, list[float]] = {}
    for r in runs:
        if "rows" in r and r.get("cold_ttft_mean") is not None:
            cold.setdefault(r["slot"], []).append(r["cold_ttft_mean"] * 1e3)
    base = statistics.median(cold["baseline"]) if "baseline" in cold else None
    print("\ncold (round 0's mean per pass; median over the passes, each pass's value)")
    for slot, values in cold.items():
        m = statistics.median(values)
        vs = f"  {(m / base - 1) * 100:+.1f} % vs vLLM alone" if base and slot != "baseline" else ""
        print(f"{slot:<11} {m:7.1f} ms  ({' '.join(f'{v:.1f}' for v in values)}){vs}")


def one_memcpy_ms(path: str) -> float:
    """The floor's copy: ``h2d_ceiling.py``'s "one cudaMemcpyAsync" of the hit's bytes, in ms."""
    rows = json.load(open(path))["rows"]
    return float(next(r["ms"] for r in rows if r["way"] == "one cudaMemcpyAsync"))


def floor_line(front_ms: float, memcpy_ms: float, p50_s: float | None) -> str:
    """Issue 13's floor (a system's front end + one pinned memcpy of the hit) and a warm p50 against it."""
    floor = front_ms + memcpy_ms
    against = f"; warm p50 {p50_s * 1e3:.1f} ms = {p50_s * 1e3 / floor:.2f}x the floor" if p50_s else ""
    return f"floor: front {front_ms:.1f} + one memcpy {memcpy_ms:.2f} = {floor:.1f} ms{against}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("trace")
    ap.add_argument("--systems", default=None,
                    help="the traced systems to break down, comma-separated (default: every kvbm system of the "
                         "file, lmcache_timed and null)")
    ap.add_argument("--pass", dest="pass_index", type=int, default=None,
                    help="this pass alone (default: every pass, the breakdown pools their warm requests)")
    ap.add_argument("--h2d", default=None, metavar="H2D_CEILING_JSON",
                    help="h2d_ceiling.py's result on the same machine: each broken-down system's floor (its "
                         "median front end + one pinned memcpy of the hit) and its warm p50 against it")
    args = ap.parse_args()
    memcpy_ms = one_memcpy_ms(args.h2d) if args.h2d else None
    runs = load_runs(args.results, args.pass_index)
    if not [r for r in runs if "rows" in r]:
        raise SystemExit(f"no engine run with rows in {args.results}"
                         + (f" for pass {args.pass_index}" if args.pass_index is not None else ""))
    table(runs)
    events = [json.loads(line) for line in open(args.trace)]
    names = args.systems.split(",") if args.systems is not None else \
        list(dict.fromkeys(r["slot"] for r in runs
                           if r["slot"].startswith("ours") or base_system(r["slot"]) in TRACED_PEERS))
    p50s = {s["summary"]: s["warm_ttft_p50_median"] for s in summarize(runs)} if memcpy_ms is not None else {}
    for name in names:
        parts: list[dict] = []
        mine = [r for r in runs if r["slot"] == name and "rows" in r]
        for run in mine:
            pid = trace_pid(run, events)
            if pid is not None:
                parts += (peer_breakdown if name == "lmcache_timed" else breakdown)(
                    run["rows"], [e for e in events if e["pid"] == pid])
        if not parts:
            continue
        over = f" over {len(mine)} passes" if len(mine) > 1 else ""
        print(f"\n{name}: {len(parts)} warm requests{over} (median / min / max, ms)")
        for k in (PEER_FIELDS if name == "lmcache_timed" else FIELDS):
            v = [p[k] for p in parts]
            print(f"  {k:<11} {statistics.median(v):7.1f} {min(v):7.1f} {max(v):7.1f}")
        if memcpy_ms is not None and "front" in parts[0]:
            print("  " + floor_line(statistics.median(p["front"] for p in parts), memcpy_ms, p50s[name]))
    cold_timelines(runs, events, [n for n in names if n != "lmcache_timed"])


#: the engine's step timeline of a cold request, from kvbm's trace (``step``, ``step_forward``) or the
#: null connector's (``null_step``, ``null_forward``): when the lookup answered, when each step was
#: planned (ms after the request was sent), each step's forward on the engine's thread (wall, CPU),
#: and the first token after the last step was planned
COLD_FIELDS = ("ttft", "lookup_at", "step1_at", "step2_at", "fwd1", "fwd1_cpu", "fwd2", "fwd2_cpu", "after_last")
COLD_EVENTS = {"null": ("null_lookup", "null_step", "null_forward")}
KVBM_COLD_EVENTS = ("prepare_load", "step", "step_forward")


def cold_timeline(rows: list[dict], events: list[dict], names: tuple[str, str, str]) -> list[dict]:
    """Per cold request (round 0) but the first (the engine's first request): see :data:`COLD_FIELDS`
    (nan where the trace has no such event)."""
    lookup, step, forward = names
    nan = float("nan")
    out = []
    for r in [r for r in rows if r["round"] == 0][1:]:
        t0, t1 = r["t0"], r["t0"] + r["ttft_s"]
        mine = [e for e in events if t0 <= e["t"] <= t1 + 0.002]
        pick = lambda what: [e for e in mine if e["what"] == what]  # noqa: E731
        lookups, steps, fwds = pick(lookup), [e for e in pick(step) if e["t"] <= t1], pick(forward)
        at = lambda es, i: (es[i]["t"] - t0) * 1e3 if len(es) > i else nan  # noqa: E731
        ms = lambda i, k: fwds[i][k] if len(fwds) > i else nan  # noqa: E731
        out.append({"ttft": r["ttft_s"] * 1e3, "lookup_at": at(lookups, 0), "step1_at": at(steps, 0),
                    "step2_at": at(steps, 1), "fwd1": ms(0, "ms"), "fwd1_cpu": ms(0, "cpu_ms"),
                    "fwd2": ms(1, "ms"), "fwd2_cpu": ms(1, "cpu_ms"),
                    "after_last": (t1 - steps[-1]["t"]) * 1e3 if steps else nan})
    return out


def cold_timelines(runs: list[dict], events: list[dict], names: list[str]) -> None:
    """The cold timeline's medians per system (``names``: kvbm's and the null connector's)."""
    lines = []
    for name in names:
        parts: list[dict] = []
        for run in [r for r in runs if r["slot"] == name and "rows" in r]:
            pid = trace_pid(run, events)
            if pid is not None:
                parts += cold_timeline(run["rows"], [e for e in events if e["pid"] == pid],
                                       COLD_EVENTS.get(name, KVBM_COLD_EVENTS))
        if parts:
            lines.append(f"{name:<11} " + " ".join(f"{statistics.median(p[k] for p in parts):9.1f}"
                                                   for k in COLD_FIELDS) + f"  ({len(parts)})")
    if lines:
        print("\ncold requests' timeline (medians, ms; the requests counted in brackets)")
        print(f"{'system':<11} " + " ".join(f"{k:>9}" for k in COLD_FIELDS))
        print("\n".join(lines))


if __name__ == "__main__":
    main()
