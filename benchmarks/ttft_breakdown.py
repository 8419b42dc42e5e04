"""Where a warm request's TTFT goes with kvbm, from one harness run (``vllm_peers.py`` JSONL) and
the connector's trace of the same run (``KVBM_CONNECTOR_TRACE``); plus the peers' table.

    python3 benchmarks/ttft_breakdown.py RESULTS.jsonl TRACE.jsonl [--systems ours,ours_async]

Each system ran in its own engine process; the trace's processes are taken in the order the
systems ran. Per warm request (round > 0), from the row's start time ``t0``:
  front      t0 -> the scheduler role asks the leader (vLLM front end, request hashing, queue)
  lookup     PrepareLoad round trip (match + count + pin at the leader)
  to_copy    PrepareLoad answered -> the copy is sent to the worker daemon (vLLM allocation; with
             early loads the scheduler role sends it from update_state_after_alloc, else the
             worker role does, after the step's PrepareStore and input preparation)
  head_start the copy sent early -> the worker role asks for it (0 without early loads)
  wait       the worker role's Transfer submitted -> answered (what the engine's thread waits)
  after_load load done -> the request finished in the scheduler (forward, sampling, output)
  ret        finished -> generate() returned
  (front + lookup + to_copy + head_start + wait + after_load + ret = ttft)
  store_prep PrepareStore round trip of the step (inside to_copy or head_start)
  copy       the copy on the daemon's lane, from its answer (it starts at the end of to_copy)
"""
from __future__ import annotations

import argparse
import json
import statistics

FIELDS = ("ttft", "front", "lookup", "to_copy", "head_start", "wait", "after_load", "ret", "store_prep", "copy",
          "blocks")


def load_rows(path: str) -> dict[str, dict]:
    out = {}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if "rows" in d:
                out[d["system"]] = d
    return out


def breakdown(rows: list[dict], events: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["round"] == 0:
            continue
        t0, t1 = r["t0"], r["t0"] + r["ttft_s"]
        mine = [e for e in events if t0 <= e["t"] <= t1 + 0.002]
        pick = lambda what: [e for e in mine if e["what"] == what]  # noqa: E731
        lookups, loads, finished = pick("prepare_load"), pick("load"), pick("finished")
        if not (lookups and loads and finished):
            continue
        p, ld, f = lookups[-1], loads[0], finished[-1]
        load_start = ld["t"] - ld["submit_to_done_ms"] / 1e3
        early = [e for e in pick("early_load") if e["req"] == ld["req"]]
        copy_start = early[0]["t"] if early else load_start
        out.append({"ttft": r["ttft_s"] * 1e3, "front": (p["t"] - p["ms"] / 1e3 - t0) * 1e3, "lookup": p["ms"],
                    "to_copy": (copy_start - p["t"]) * 1e3, "head_start": (load_start - copy_start) * 1e3,
                    "wait": ld["submit_to_done_ms"], "after_load": (f["t"] - ld["t"]) * 1e3,
                    "ret": (t1 - f["t"]) * 1e3, "store_prep": sum(e["ms"] for e in pick("prepare_store")),
                    "copy": ld.get("copy_ms", float("nan")), "blocks": ld["blocks"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("trace")
    ap.add_argument("--systems", default="ours,ours_async", help="traced systems, in the order they ran")
    args = ap.parse_args()
    results = load_rows(args.results)
    print(f"{'system':<11} {'p50 ms':>7} {'p90 ms':>7} {'from cache':>10}  ratio to the best peer")
    peers = {k: v for k, v in results.items() if k not in ("baseline", "recompute") and not k.startswith("ours")}
    best = min(v["warm_ttft_p50"] for v in peers.values()) if peers else None
    for name, d in results.items():
        ratio = f"{d['warm_ttft_p50'] / best:.2f}x" if best else "-"
        print(f"{name:<11} {d['warm_ttft_p50'] * 1e3:7.1f} {d['warm_ttft_p90'] * 1e3:7.1f} "
              f"{d['warm_cached_frac'] * 100:9.1f}%  {ratio}")
    events = [json.loads(line) for line in open(args.trace)]
    pids: list[int] = []
    for e in events:
        if e["pid"] not in pids:
            pids.append(e["pid"])
    for name, pid in zip(args.systems.split(","), pids):
        if name not in results:
            continue
        parts = breakdown(results[name]["rows"], [e for e in events if e["pid"] == pid])
        if not parts:
            continue
        print(f"\n{name}: {len(parts)} warm requests (median / min / max, ms)")
        for k in FIELDS:
            v = [p[k] for p in parts]
            print(f"  {k:<11} {statistics.median(v):7.1f} {min(v):7.1f} {max(v):7.1f}")


if __name__ == "__main__":
    main()
