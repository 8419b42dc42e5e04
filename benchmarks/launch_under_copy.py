"""Does a host -> GPU copy in another process make an engine's kernel launches cost more CPU?

An eager vLLM forward launches hundreds of small kernels from the engine's thread. Overlapped with
a load's copy (kvbm's layer-pipelined load) that thread's CPU time for the forward was 22-38 ms
against 19 ms after a synchronous copy (H100/H200, 2026-11-26/27, ``ttft_breakdown.py``'s
``forward_cpu``). A launch writes its command to the GPU over the same PCIe direction the copy's
data uses. This measures the launch cost alone, without vLLM:

    python3 benchmarks/launch_under_copy.py [--launches 4000] [--reps 7] [--copy-gib 2] [--json out.json]

A child process (a separate CUDA context, like kvbm's worker daemon) copies ``--copy-gib`` GiB
of pinned host memory into the GPU in a loop (one ``cudaMemcpyAsync`` after another) while told
to; this process times ``--launches`` small operations of each kind in :data:`OPS` on its thread,
wall and CPU, alternately with the copy idle and running, ``--reps`` times each. Reports medians
(ms per 1000 operations) and the ratios.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

from provenance import provenance


def copier(gib: float, go: "mp.synchronize.Event", stop: "mp.synchronize.Event", ready: "mp.synchronize.Event",
           counter: "mp.sharedctypes.Synchronized") -> None:
    import torch
    nbytes = int(gib * (1 << 30))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev.copy_(host, non_blocking=True)
    stream.synchronize()
    ready.set()
    while not stop.is_set():
        if not go.wait(0.05):
            continue
        with torch.cuda.stream(stream):
            dev.copy_(host, non_blocking=True)
        stream.synchronize()
        with counter.get_lock():
            counter.value += 1


#: what the engine's thread does ``--launches`` times: a kernel launch (an add of 4 KiB tensors);
#: a 4 KiB copy from pageable host memory (synchronous, as vLLM's ``.to("cuda")`` of a list-built
#: tensor); a 4 KiB copy from pinned memory on the current stream, then waiting for it (a sync point)
OPS = ("add", "h2d_pageable", "h2d_pinned_sync")


def launches(op: str, n: int) -> tuple[float, float]:
    """(wall ms, CPU ms) of ``n`` operations ``op`` from this thread, then one synchronize (not counted)."""
    import torch
    a = torch.ones(1024, device="cuda")
    b = torch.ones(1024, device="cuda")
    pageable = torch.ones(1024)
    pinned = torch.ones(1024).pin_memory()
    torch.cuda.synchronize()
    w, c = time.perf_counter(), time.thread_time()
    if op == "add":
        for _ in range(n):
            torch.add(a, b, out=a)
    elif op == "h2d_pageable":
        for _ in range(n):
            a.copy_(pageable)
    else:
        stream = torch.cuda.current_stream()
        for _ in range(n):
            a.copy_(pinned, non_blocking=True)
            stream.synchronize()
    w, c = time.perf_counter() - w, time.thread_time() - c
    torch.cuda.synchronize()
    return w * 1e3, c * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    record = provenance()
    ctx = mp.get_context("spawn")
    go, stop, ready = ctx.Event(), ctx.Event(), ctx.Event()
    counter = ctx.Value("i", 0)
    child = ctx.Process(target=copier, args=(args.copy_gib, go, stop, ready, counter), daemon=True)
    child.start()
    if not ready.wait(120):
        raise SystemExit("the copying process did not start")
    for op in OPS:
        launches(op, 200)  # warm-up
    per: dict[str, list[tuple[float, float]]] = {f"{op} {s}": [] for op in OPS for s in ("idle", "copying")}
    try:
        for _ in range(args.reps):
            for op, state in [(op, s) for op in OPS for s in ("idle", "copying")]:
                if state == "copying":
                    before = counter.value
                    go.set()
                    time.sleep(0.2)  # the copy is running
                else:
                    go.clear()
                    time.sleep(0.3)  # the copy in flight has ended
                per[f"{op} {state}"].append(launches(op, args.launches))
                if state == "copying":  # (a 2 GiB copy takes ~40 ms: several ran by now)
                    assert counter.value > before, "no copy ran while the operations were timed"
            go.clear()
    finally:
        stop.set()
        child.join(30)
    k = 1000 / args.launches
    rows = {s: {"wall_ms_per_1000": round(statistics.median(x[0] for x in v) * k, 3),
                "cpu_ms_per_1000": round(statistics.median(x[1] for x in v) * k, 3),
                "reps": [[round(a * k, 3), round(b * k, 3)] for a, b in v]} for s, v in per.items()}
    ratios = {op: {"wall": round(rows[f"{op} copying"]["wall_ms_per_1000"] / rows[f"{op} idle"]["wall_ms_per_1000"], 3),
                   "cpu": round(rows[f"{op} copying"]["cpu_ms_per_1000"] / rows[f"{op} idle"]["cpu_ms_per_1000"], 3)}
              for op in OPS}
    out = {"provenance": record, "launches": args.launches, "copy_gib": args.copy_gib, "copies_done": counter.value,
           "rows": rows, "copying_to_idle": ratios}
    for s, r in rows.items():
        print(f"{s:<24} wall {r['wall_ms_per_1000']:.3f} ms, CPU {r['cpu_ms_per_1000']:.3f} ms per 1000")
    for op, r in ratios.items():
        print(f"{op}: while copying / idle: wall {r['wall']:.3f}x, CPU {r['cpu']:.3f}x")
    print(f"({counter.value} copies of {args.copy_gib:g} GiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
