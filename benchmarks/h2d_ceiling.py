"""How fast can a 20K-token prefix (1268 blocks x 2.25 MiB, Qwen3-4B shape) get from pinned host
memory into the GPU? The bound under kvbm's onboard time, measured several ways in one run.

    python3 benchmarks/h2d_ceiling.py [--blocks 1268] [--block-mib 2.25] [--reps 5] [--spread N --gap-s S]
                                      [--json out.json]

Ways: one cudaMemcpyAsync of the whole contiguous range (the reference); the range split over 2
and 4 streams at once; kvbm's path (cudaMemcpyBatchAsync of one copy per block, to scattered
engine blocks); and an SM copy kernel that reads the pinned memory through UVA (cupy), which
uses no copy engine. Prints GB/s and each way's ratio to the reference.

``--spread N``: the reference copy again N times, ``--gap-s`` seconds apart (the GPU idles between
them, as between a benchmark's requests), and its p50 / p90 / max: how much one host's own copy of
the same bytes varies, the bound under a load's p90.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from provenance import provenance


def samples(fn, reps: int, gap_s: float = 0.0) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` (each synchronised), ``gap_s`` idle before each."""
    out = []
    for _ in range(reps):
        if gap_s:
            time.sleep(gap_s)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` (each call synchronised), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    return statistics.median(samples(fn, reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1268)
    ap.add_argument("--block-mib", type=float, default=2.25)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--spread", type=int, default=0, help="time the reference copy this many more times, "
                                                          "spaced, and report its spread [0: not]")
    ap.add_argument("--gap-s", type=float, default=0.3, help="idle seconds between the --spread copies [0.3]")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    record = provenance()
    block = int(args.block_mib * (1 << 20))
    n = args.blocks
    nbytes = n * block
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    engine_blocks = int(n * 1.5)  # the engine's cache: the request's blocks are scattered in it
    dev = torch.empty(engine_blocks * block, dtype=torch.uint8, device="cuda")
    flat = dev[:nbytes]
    results: dict[str, float] = {}

    def reference() -> None:
        flat.copy_(host, non_blocking=True)
    results["one cudaMemcpyAsync"] = timed(reference, args.reps)

    for k in (2, 4):
        streams = [torch.cuda.Stream() for _ in range(k)]
        parts = np.linspace(0, nbytes, k + 1).astype(np.int64) // block * block

        def split(streams=streams, parts=parts):
            for i, s in enumerate(streams):
                with torch.cuda.stream(s):
                    flat[parts[i]:parts[i + 1]].copy_(host[parts[i]:parts[i + 1]], non_blocking=True)
        results[f"{k} streams at once"] = timed(split, args.reps)

    try:
        try:  # cuda-python (self-contained: this probe runs before kvbm's wheels are installed)
            from cuda.bindings import runtime as rt
        except ImportError:
            from cuda import cudart as rt

        def check(result, what):
            if result[0] != rt.cudaError_t.cudaSuccess:
                raise RuntimeError(f"{what}: {result[0]}")
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        attr.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
        targets = np.random.default_rng(0).permutation(engine_blocks)[:n]
        dst = (dev.data_ptr() + targets * block).tolist()
        src = (host.data_ptr() + np.arange(n) * block).tolist()
        sizes = [block] * n
        stream = torch.cuda.Stream()

        def batch():
            check(rt.cudaMemcpyBatchAsync(dst, src, sizes, n, [attr], [0], 1, stream.cuda_stream),
                  "cudaMemcpyBatchAsync")
        results["kvbm: batch of per-block copies, scattered"] = timed(batch, args.reps)
    except Exception as exc:  # no cuda-python: skip this way
        print(json.dumps({"skipped": "batch", "why": repr(exc)}))

    try:
        import cupy as cp
        kernel = cp.RawKernel(r"""
        extern "C" __global__ void copy16(const ulonglong2* __restrict__ src, ulonglong2* __restrict__ dst,
                                          unsigned long long n) {
            for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
                 i += (unsigned long long)gridDim.x * blockDim.x) dst[i] = src[i];
        }""", "copy16")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        words = nbytes // 16
        for per_sm in (2, 8):
            def sm_copy(per_sm=per_sm):
                kernel((sms * per_sm,), (512,), (cp.uint64(host.data_ptr()), cp.uint64(flat.data_ptr()),
                                                 cp.uint64(words)),
                       stream=cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
            results[f"SM copy kernel over UVA ({per_sm} blocks/SM)"] = timed(sm_copy, args.reps)
        assert torch.equal(flat[:block].cpu(), host[:block]), "the SM copy kernel copied wrong bytes"
    except ImportError as exc:
        print(json.dumps({"skipped": "sm copy", "why": repr(exc)}))

    spread: dict[str, float | int] = {}
    if args.spread > 0:
        ms = sorted(x * 1e3 for x in samples(reference, args.spread, args.gap_s))
        spread = {"copies": len(ms), "gap_s": args.gap_s, "p50_ms": round(statistics.median(ms), 2),
                  "p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 2),
                  "min_ms": round(ms[0], 2), "max_ms": round(ms[-1], 2)}
        print(f"one cudaMemcpyAsync, {len(ms)} copies {args.gap_s:g} s apart: p50 {spread['p50_ms']} "
              f"p90 {spread['p90_ms']} min {spread['min_ms']} max {spread['max_ms']} ms")

    ref = results["one cudaMemcpyAsync"]
    rows = [{"way": k, "ms": round(v * 1e3, 2), "GB_s": round(nbytes / v / 1e9, 1), "vs_one_copy": round(ref / v, 3)}
            for k, v in results.items()]
    summary = {"provenance": record, "bytes": nbytes, "blocks": n, "block_bytes": block,
               "device": torch.cuda.get_device_name(0), "rows": rows}
    if spread:
        summary["spread"] = spread
    for r in rows:
        print(f"{r['way']:<46} {r['ms']:8.2f} ms {r['GB_s']:6.1f} GB/s  {r['vs_one_copy']:.3f}x")
    print(json.dumps({k: v for k, v in summary.items() if k != "provenance"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
