"""Would "copy the hit into a GPU staging area as soon as it is matched, scatter it device to device
once vLLM allocated the blocks" pay? Times the two halves against today's direct load.

    python3 benchmarks/staging_scatter.py [--blocks 1268] [--groups 6] [--reps 5] [--json out.json]

Why (issue 13, "start the copy earlier"): on the H200 a 20K hit's copy starts ~20 ms after the
request arrived (one machine's medians: vLLM's front end 7.8, the lookup 4.9, allocation and dispatch 6.8 ms; README
"seventh session"); the lookup knows the slots ~14 ms before vLLM's blocks exist. If the host ->
GPU copy ran into a staging buffer from the lookup on, only a device -> device scatter would be
left once the blocks are known. This measures, with vLLM's Qwen3-4B block shape (2.25 MiB blocks,
36 pages of 64 KiB) and the daemon's copier (``--cuda-copy auto``):

* ``direct``: today's load, pinned G2 slots -> the other process's KV cache (CUDA IPC), in
  ``--groups`` layer groups (one copy per block and group);
* ``stage``: the same slots -> a staging buffer of this process (one copy per block);
* ``scatter``: staging -> the other process's KV cache, device to device, per block and group;
* ``kernel``: the same scatter as one ``index_copy_`` kernel per group (8-byte words), the KV
  cache wrapped as a tensor through ``__cuda_array_interface__``; its bytes are checked once;
* ``pipeline`` (idle only): the design's timeline. At t0 the first ``staged`` layer groups of
  every block are copied into a group-major staging buffer (one copy per block and group, as a
  load's pieces); ``--delays`` ms later the engine's blocks are "known": each staged group is
  scattered by one kernel on a second stream once its copies landed, and the other groups are
  copied straight into the blocks on the load stream. Reports when each group is in the engine's
  blocks, counted from t0; ``staged`` 0 is today's direct load issued at t0 + delay;
* each of the first four with the other process idle and running bf16 matmuls (``busy``: what the engine's forward
  loses to a scatter, reported as its matmul rate during the copy against alone).

Reports per row the GPU time (events on the copy stream) and the issue's CPU time, medians over
``--reps``. H100, 2026-11-26 ninth session, one run (``results/staging_scatter_h100_2026-11-26n.json``):
staged 54.5 ms against 61.3 scattered; the per-copy scatter 25.9 ms and as much issue CPU, and a
concurrent matmul fell from 674 to 402 TFLOPS beside it.
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
from kvbm_worker.grouping import even_bounds
from kvbm_worker.handlers.cuda_copier import CopyMechanism, CudaCopier, Direction

BLOCK, PAGES = 2304 << 10, 36
PAGE = BLOCK // PAGES


def timed(copier: CudaCopier, src: np.ndarray, dst: np.ndarray, unit: int, host_src: bool) -> tuple[float, float]:
    """(GPU ms, issue CPU ms) of one batch of ``unit``-byte copies on the load stream."""
    stream = copier.streams[Direction.H2D]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record(stream)
    c = time.thread_time()
    copier._dma(src, dst, unit, host_src, mechanism(copier), stream)
    cpu = (time.thread_time() - c) * 1e3
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end), cpu


def mechanism(copier: CudaCopier) -> CopyMechanism:
    """The copier's mechanism, ``direct`` for ``auto`` (the daemon's default)."""
    return CopyMechanism(copier.mechanism if copier.mechanism != "auto" else "direct")


def page_bounds(groups: int) -> list[tuple[int, int]]:
    """Each layer group's pages ``[lo, hi)`` of a block, equal groups (the daemon's ``even`` shape)."""
    ends = even_bounds(PAGES, groups)
    return list(zip([0, *ends[:-1]], ends))


def grouped(src_base: np.ndarray, dst_base: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Per group, per block: the group's pages (one run per block and group), groups outermost."""
    bounds = page_bounds(groups)
    s = np.concatenate([src_base + lo * PAGE for lo, _ in bounds])
    d = np.concatenate([dst_base + lo * PAGE for lo, _ in bounds])
    sizes = [(hi - lo) * PAGE for lo, hi in bounds]
    return s, d, sizes


class DeviceRange:
    """A raw device range (another process's memory, opened through CUDA IPC) as torch wraps one
    without copying: ``torch.as_tensor(DeviceRange(ptr, nbytes), device=...)`` (8-byte words)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes // 8,), "typestr": "<i8", "data": (ptr, False),
                                         "version": 3, "strides": None}


def kernel_scatter(kv: torch.Tensor, staging: torch.Tensor, idx: torch.Tensor, groups: int) -> None:
    """Staged block ``i`` (``staging[i]``) -> engine block ``idx[i]`` (``kv[idx[i]]``), one
    ``index_copy_`` per layer group, groups in order (as a layer-pipelined load lands them). Both
    are ``[blocks, words]`` int64 views; the group bounds are :func:`page_bounds`'."""
    words = PAGE // 8
    for lo, hi in page_bounds(groups):
        kv[:, lo * words:hi * words].index_copy_(0, idx, staging[:, lo * words:hi * words])


def timed_kernel(stream: Any, kv: torch.Tensor, staging: torch.Tensor, idx: torch.Tensor, groups: int
                 ) -> tuple[float, float]:
    """(GPU ms, issue CPU ms) of :func:`kernel_scatter` on ``stream``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record(stream)
    c = time.thread_time()
    with torch.cuda.stream(stream):
        kernel_scatter(kv, staging, idx, groups)
    cpu = (time.thread_time() - c) * 1e3
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end), cpu


def pipeline(copier: CudaCopier, slots: np.ndarray, blocks: np.ndarray, kv: torch.Tensor, staging: torch.Tensor,
             idx: torch.Tensor, groups: int, staged: int, delay_ms: float, side: Any) -> list[float]:
    """One run of the ``pipeline`` timeline (module docstring): per group, ms from t0 until it is
    in the engine's blocks. ``kv``: the engine's ``[blocks, words]`` int64 view; ``staging``: a
    device uint8 buffer of at least every block's bytes; ``side``: the kernels' stream."""
    stream, mech = copier.streams[Direction.H2D], mechanism(copier)
    n, words = len(slots), PAGE // 8
    bounds = page_bounds(groups)
    t0 = torch.cuda.Event(enable_timing=True)
    landed = [torch.cuda.Event(enable_timing=True) for _ in range(groups)]
    staged_at: list[Any] = []
    torch.cuda.synchronize()
    t0.record(stream)
    start = time.perf_counter()
    for lo, hi in bounds[:staged]:  # group-major: group g of block i at n * lo * PAGE + i * size
        size = (hi - lo) * PAGE
        at = staging.data_ptr() + n * lo * PAGE + np.arange(n, dtype=np.int64) * size
        copier._dma(slots + lo * PAGE, at, size, True, mech, stream)
        staged_at.append(torch.cuda.Event())
        staged_at[-1].record(stream)
    while (time.perf_counter() - start) * 1e3 < delay_ms:
        time.sleep(0.0002)
    for g, (lo, hi) in enumerate(bounds):
        if g < staged:
            side.wait_event(staged_at[g])
            with torch.cuda.stream(side):
                part = staging[n * lo * PAGE:n * hi * PAGE].view(torch.int64).view(n, (hi - lo) * words)
                kv[:, lo * words:hi * words].index_copy_(0, idx, part)
            landed[g].record(side)
        else:
            size = (hi - lo) * PAGE
            copier._dma(slots + lo * PAGE, blocks + lo * PAGE, size, True, mech, stream)
            landed[g].record(stream)
    torch.cuda.synchronize()
    return [t0.elapsed_time(e) for e in landed]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1268)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--delays", default="0,5,8", help="pipeline: ms from t0 until the blocks are known")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n = args.blocks
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=ipc_engine, args=(child, 2 * n * BLOCK, 8192), daemon=True)
    proc.start()
    torch.cuda.set_device(0)
    check(cudart().cudaSetDevice(0), "cudaSetDevice")
    with pinned_copier(BLOCK, 2 * n) as (host, copier):
        staging = torch.empty(n * BLOCK, dtype=torch.uint8, device="cuda:0")
        kv = open_ipc(parent.recv())
        rng = np.random.default_rng(0)
        slots = host.address + np.sort(rng.choice(2 * n, n, replace=False)).astype(np.int64) * BLOCK
        chosen = rng.permutation(2 * n)[:n].astype(np.int64)
        blocks = kv + chosen * BLOCK  # vLLM's blocks, scattered
        stage_at = staging.data_ptr() + np.arange(n, dtype=np.int64) * BLOCK
        kv_words = torch.as_tensor(DeviceRange(kv, 2 * n * BLOCK), device="cuda:0").view(2 * n, BLOCK // 8)
        staged_words = staging.view(torch.int64).view(n, BLOCK // 8)
        idx = torch.as_tensor(chosen, device="cuda:0")
        staging.random_(0, 256)  # the kernel's bytes, checked once: each staged block at its engine block
        kernel_scatter(kv_words, staged_words, idx, args.groups)
        torch.cuda.synchronize()
        if not torch.equal(kv_words.index_select(0, idx), staged_words):
            raise SystemExit("kernel scatter: the engine's blocks do not hold the staged bytes")
        rows: list[dict[str, Any]] = []
        parent.send(3.0)
        parent.recv()
        alone = parent.recv()  # the matmul rate with nothing else on the GPU
        try:
            for busy in (False, True):
                for what in ("direct", "stage", "scatter", "kernel"):
                    gpu: list[float] = []
                    cpu: list[float] = []
                    if busy:
                        parent.send(2.0)
                        parent.recv()
                    t_end = time.perf_counter() + (1.8 if busy else 0)
                    while len(gpu) < args.reps or time.perf_counter() < t_end:
                        if what == "stage":
                            g, c = timed(copier, slots, stage_at, BLOCK, True)
                        elif what == "kernel":
                            g, c = timed_kernel(copier.streams[Direction.H2D], kv_words, staged_words, idx,
                                                args.groups)
                        else:
                            src = slots if what == "direct" else stage_at
                            s, d, sizes = grouped(src, blocks, args.groups)
                            g = c = 0.0
                            per = len(s) // args.groups
                            for k, size in enumerate(sizes):  # one batch per group, as the lane's pieces
                                gk, ck = timed(copier, s[k * per:(k + 1) * per], d[k * per:(k + 1) * per], size,
                                               what == "direct")
                                g, c = g + gk, c + ck
                        gpu.append(g)
                        cpu.append(c)
                    row: dict[str, Any] = {"busy": busy, "what": what, "blocks": n, "groups": args.groups,
                                           "gpu_ms": round(statistics.median(gpu), 2),
                                           "issue_cpu_ms": round(statistics.median(cpu), 2)}
                    if busy:
                        row["matmul_tflops"] = round(parent.recv(), 1)
                        row["matmul_alone_tflops"] = round(alone, 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            side = torch.cuda.Stream()
            for delay in (float(d) for d in args.delays.split(",")):
                for staged in sorted({0, 1, 2, args.groups}):
                    runs = [pipeline(copier, slots, blocks, kv_words, staging, idx, args.groups, staged, delay, side)
                            for _ in range(args.reps)]
                    per_group = [round(statistics.median(r[g] for r in runs), 2) for g in range(args.groups)]
                    row = {"busy": False, "what": "pipeline", "blocks": n, "groups": args.groups, "staged": staged,
                           "delay_ms": delay, "landed_ms": per_group, "last_ms": per_group[-1]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            # the pipeline's bytes, checked once (staged and direct groups): each block's slot at its engine block
            rows_of = (slots - host.address) // BLOCK
            host.slots[rows_of] = rng.integers(0, 256, (n, BLOCK), dtype=np.uint8)
            kv_words.zero_()
            pipeline(copier, slots, blocks, kv_words, staging, idx, args.groups, min(2, args.groups), 1.0, side)
            if not np.array_equal(kv_words.index_select(0, idx).cpu().numpy().view(np.uint8), host.slots[rows_of]):
                raise SystemExit("pipeline: the engine's blocks do not hold the slots' bytes")
        finally:
            parent.send("stop")
            proc.join(10)
    write_result(args.json, args, rows)


if __name__ == "__main__":
    main()
