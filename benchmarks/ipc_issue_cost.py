"""Is it the destination that makes issuing a copy expensive? Times the CPU cost of issuing
scattered host -> GPU copies (the lane's layer-group pieces) into device memory the process
allocated itself and into memory another process exported through CUDA IPC (as the engine's
KV cache reaches the worker daemon), with that other process idle or busy with matmuls.

    python3 benchmarks/ipc_issue_cost.py [--copies 400] [--copy-kb 384] [--reps 6] [--json out.json]

Why: beside vLLM on the H200 (2026-11-26, seventh session) the lane's *own CPU time* to issue
a 418-copy piece through ``cudaMemcpyBatchAsync`` was 3.0-3.4 ms (~8 us a copy, the debug
line's per-piece CPU time), where ``benchmarks/issue_cost.py`` measured ~1 us a copy into
local memory. Mechanisms: ``direct`` (the worker's default, :mod:`kvbm_worker.handlers.cudart_direct`),
``batch`` (cuda-python), ``runs`` (one ``cudaMemcpyAsync`` per copy). Reports per row the
median over ``--reps`` of the issue's wall and thread-CPU time per copy (us) and the DMA's time.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_bench import ipc_engine, open_ipc, pinned_copier, write_result

from kvbm_worker.cuda_region import check, cudart
from kvbm_worker.handlers.cuda_copier import CopyMechanism, CudaCopier, Direction
from kvbm_worker.pools import HostPool

SLOT = 2304 << 10


def run(copier: CudaCopier, host: HostPool, dst_base: int, n: int, size: int, mech: str, reps: int,
        rng: np.random.Generator) -> dict[str, Any]:
    stream = copier.streams[Direction.H2D]
    wall, cpu, dma = [], [], []
    slots = host.buffer.nbytes // SLOT
    for _ in range(reps):
        torch.cuda.synchronize()
        src = host.address + np.sort(rng.choice(slots, n, replace=False)).astype(np.int64) * SLOT
        dst = dst_base + rng.permutation(n).astype(np.int64) * SLOT  # one run per block, as a group's pages
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t, c = time.perf_counter(), time.thread_time()
        copier._dma(src, dst, size, True, CopyMechanism(mech), stream)  # (cut at pinned-range edges)
        wall.append((time.perf_counter() - t) * 1e6 / n)
        cpu.append((time.thread_time() - c) * 1e6 / n)
        end.record(stream)
        end.synchronize()
        dma.append(start.elapsed_time(end))
    return {"mechanism": mech, "copies": n, "copy_bytes": size, "issue_wall_us_per_copy": round(statistics.median(wall), 2),
            "issue_cpu_us_per_copy": round(statistics.median(cpu), 2), "dma_ms": round(statistics.median(dma), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=400)
    ap.add_argument("--copy-kb", type=int, default=384)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n, size = args.copies, args.copy_kb << 10
    nbytes = n * SLOT
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=ipc_engine, args=(child, nbytes, 4096), daemon=True)
    proc.start()
    torch.cuda.set_device(0)
    check(cudart().cudaSetDevice(0), "cudaSetDevice")  # (cuda-python's runtime: the lane's _enter_lane does this)
    with pinned_copier(SLOT, (8 << 30) // SLOT) as (host, copier):
        local = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        ipc = open_ipc(parent.recv())
        rng = np.random.default_rng(0)
        rows = []
        try:
            for busy in (False, True):
                for where, base in (("local", local.data_ptr()), ("ipc", ipc)):
                    for mech in ("direct", "batch", "runs"):
                        if busy:
                            parent.send(3.0)
                            parent.recv()
                        row: dict[str, Any] = {"engine_busy": busy, "destination": where}
                        try:
                            row |= run(copier, host, base, n, size, mech, args.reps, rng)
                        except Exception as exc:  # (recorded: the other rows still run)
                            row |= {"mechanism": mech, "error": str(exc)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        if busy:
                            parent.recv()  # the busy spell's end, before the next row's own
        finally:
            parent.send("stop")
            proc.join(10)
    write_result(args.json, args, rows)

if __name__ == "__main__":
    main()
