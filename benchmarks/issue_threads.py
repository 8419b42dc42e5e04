"""Does issuing a load's copies from several threads at once take less time than from one?

    python3 benchmarks/issue_threads.py [--piece-mb 256] [--threads 1,2,3,4] [--sizes 64,720]
        [--reps 8] [--json out.json]

Why (2026-11-27, twentieth session): vLLM 0.26's V2 model runner gives Qwen3 one KV allocation per
layer, so a block's pages cannot merge into one copy: a 256 MiB piece of a layer-grouped load is
~4096 copies of 64 KiB, and the worker's lane spends ~1.1 us of CPU on each (4.5 ms a piece, about
the piece's DMA time: the copy engine waits for the lane). The driver's cost is per copy; this asks
whether two or more threads, each issuing its share of a piece on its own stream, divide it.

A pinned host pool like G2 (1 GiB registrations), a device buffer, and
:class:`~kvbm_worker.handlers.cuda_copier.CudaCopier`'s ``_issue`` (the worker's mechanism: ``direct``
where the runtime has it, else ``batch``) of four pieces back to back, as the lane queues them; each
piece's copies are scattered (none merge; cut at the pinned ranges' edges as the worker cuts them).
With ``T`` > 1 threads the worker's own :class:`~kvbm_worker.handlers.issuers.Issuers` issues each
piece in ``T`` contiguous shares (share 0 by the calling thread on the copier's H2D stream, the others
by helper threads on their own streams, every call giving up the interpreter lock). Reports per copy
size and thread count: the median wall time to issue a piece (all shares submitted), the calling
thread's CPU time for it, and the DMA time of the four pieces (CUDA events on the H2D stream).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gpu_bench import pinned_copier, write_result

from kvbm_worker.handlers.cuda_copier import CopyMechanism, CudaCopier, Direction
from kvbm_worker.handlers.issuers import Issuers
from kvbm_worker.pools import HostPool

PIECES = 4  # as the lane queues them (GROUP_DEPTH 3 behind the first)


def run(copier: CudaCopier, host: HostPool, dev, piece: int, size: int, threads: int, reps: int,
        rng: np.random.Generator) -> dict:
    n = piece // size
    units = host.buffer.nbytes // size
    main = copier.streams[Direction.H2D]
    mech = CopyMechanism.DIRECT if copier._direct is not None else CopyMechanism.BATCH
    issuers = Issuers(copier._direct, copier.device, threads, min_copies=threads) \
        if copier._direct is not None and threads > 1 else None
    wall: list[list[float]] = [[] for _ in range(PIECES)]
    cpu: list[float] = []
    total: list[float] = []
    with torch.cuda.device(copier.device):
        for _ in range(reps):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(main)
            for k in range(PIECES):
                src = host.address + rng.choice(units, n, replace=False).astype(np.int64) * size
                dst = dev.data_ptr() + (k * n + rng.permutation(n).astype(np.int64)) * size
                src, dst, lengths = copier.pinned.split(src, dst, np.full(n, size, np.int64), src)
                t, c = time.perf_counter(), time.thread_time()
                if issuers is not None:
                    issuers.issue(dst, src, lengths, main.cuda_stream)
                else:
                    copier._issue(src, dst, lengths, mech, main)
                wall[k].append((time.perf_counter() - t) * 1e3)
                if k == 1:
                    cpu.append((time.thread_time() - c) * 1e3)
            end.record(main)
            end.synchronize()
            total.append(start.elapsed_time(end))
    if issuers is not None:
        issuers.close()
    piece_ms = statistics.median(wall[1])
    return {"copy_bytes": size, "copies_per_piece": n, "threads": threads,
            "mechanism": mech.value if issuers is None else "direct, split (issuers)",
            "issue_ms_by_piece": [round(statistics.median(v), 3) for v in wall],
            "lane_cpu_ms_per_piece": round(statistics.median(cpu), 3),
            "dma_ms_4_pieces": round(statistics.median(total), 2),
            "issue_us_per_copy": round(piece_ms * 1e3 / n, 3),
            "issue_gbps": round(piece / piece_ms / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--piece-mb", type=int, default=256)
    ap.add_argument("--threads", default="1,2,3,4", help="comma list of issuing thread counts")
    ap.add_argument("--sizes", default="64,720", help="comma list of copy sizes in KiB")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    piece = args.piece_mb << 20
    counts = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    with pinned_copier(2304 << 10, (12 << 30) // (2304 << 10)) as (host, copier):
        dev = torch.empty(PIECES * piece, dtype=torch.uint8, device=f"cuda:{copier.device}")
        for size in (int(s) << 10 for s in args.sizes.split(",")):
            for _ in range(2):  # two alternating passes over the thread counts
                for threads in counts:
                    row = run(copier, host, dev, piece, size, threads, args.reps, rng)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    write_result(args.json, args, rows)


if __name__ == "__main__":
    main()
