"""What it costs the worker's copy lane to *issue* a load's piece (not to copy it), on a GPU:
is the cost per copy, or per byte, and what does a busy CPU do to it?

    python3 benchmarks/issue_cost.py [--piece-mb 256] [--reps 8] [--hog 0,12] [--json out.json]

Beside vLLM on the H100 (2026-11-26) issuing a 256 MiB piece of a layer-grouped load took the
lane 3-6 ms, against 1.0 ms with the daemon alone; at 6 ms a piece the copy waits for the lane
(the DMA moves 256 MiB in ~4.6 ms), and the whole 3 GB load took 67-90 ms instead of 58. This
times the same call outside the daemon: a pinned host pool like G2 (shared memory registered
in 1 GiB ranges), a device buffer, and :class:`~kvbm_worker.handlers.cuda_copier.CudaCopier`'s
``_issue`` of one piece cut into copies of 64 KiB .. 2.25 MiB (scattered, so none merge) and as
one copy, with ``cudaMemcpyBatchAsync`` (``batch``) and one ``cudaMemcpyAsync`` per copy
(``runs``); four pieces back to back, as the lane queues them. ``--hog N``: N processes spin
on the CPU meanwhile (the engine's processes beside the daemon). Reports the median issue time
of each piece position and of the whole DMA.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gpu_bench import Hogs, pinned_copier, write_result

from kvbm_worker.handlers.cuda_copier import CopyMechanism, CudaCopier, Direction
from kvbm_worker.pools import HostPool

COPY_SIZES = (64 << 10, 384 << 10, 720 << 10, 2304 << 10)  # a page, the 6-group and 11-page group runs, a block


def run(copier: CudaCopier, host: HostPool, dev, piece: int, size: int, mech: str, reps: int,
        rng: np.random.Generator) -> dict:
    n = piece // size  # copies per piece
    slots = host.buffer.nbytes // size
    stream = copier.streams[Direction.H2D]
    issue: list[list[float]] = [[] for _ in range(4)]
    total: list[float] = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for k in range(4):  # four pieces, as the lane queues them (GROUP_DEPTH 3 behind the first)
            src = host.address + rng.choice(slots, n, replace=False).astype(np.int64) * size
            dst = dev.data_ptr() + (k * n + rng.permutation(n).astype(np.int64)) * size
            t = time.perf_counter()
            with torch.cuda.device(copier.device):
                copier._dma(src, dst, size, True, CopyMechanism(mech), stream)  # (cut at pinned-range edges)
            issue[k].append((time.perf_counter() - t) * 1e3)
        end.record(stream)
        end.synchronize()
        total.append(start.elapsed_time(end))
    return {"copy_bytes": size, "copies_per_piece": n, "mechanism": mech,
            "issue_ms_by_piece": [round(statistics.median(v), 3) for v in issue],
            "dma_ms_4_pieces": round(statistics.median(total), 2),
            "issue_us_per_copy": round(statistics.median(issue[1]) * 1e3 / n, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--piece-mb", type=int, default=256)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--hog", default="0,12", help="comma list of CPU hog process counts to run under")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    piece = args.piece_mb << 20
    rng = np.random.default_rng(0)
    rows = []
    with pinned_copier(2304 << 10, (12 << 30) // (2304 << 10)) as (host, copier):
        dev = torch.empty(4 * piece, dtype=torch.uint8, device="cuda:0")
        for n in [int(h) for h in args.hog.split(",")]:
            hogs = Hogs(n)
            try:
                for size in (*COPY_SIZES, piece):
                    for mech in ("batch", "runs"):
                        if mech == "runs" and piece // size > 4096:
                            continue
                        row = {"hog_processes": n, **run(copier, host, dev, piece, size, mech, args.reps, rng)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            finally:
                hogs.close()
    write_result(args.json, args, rows)

if __name__ == "__main__":
    main()
