"""How long does queueing a 4-byte signal-word write take while a 1 GiB copy runs on the stream?

    python3 benchmarks/word_write_probe.py [--json out.json]

``host_to_host``: one ``cudaMemcpyAsync`` from a pinned word into CUDA-registered host memory (the
daemon's signal-word write before 2026-11-26's eighth session); ``via_gpu``: host -> GPU -> the
page, two asynchronous copies (``CudaCopier.write_word`` since). Each after a 1 GiB pinned ->
GPU copy queued on the same stream; prints the call's wall time (ms) and whether the word was
already written when the call returned. Five reps each; medians.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from gpu_bench import registered_page, write_result

from kvbm_worker.cuda_region import check, cudart


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rt = cudart()
    default = rt.cudaMemcpyKind.cudaMemcpyDefault
    src = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    dev = torch.zeros(8, dtype=torch.int64, device="cuda:0")
    big_src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    big_dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    stream = torch.cuda.Stream()
    rows: list[dict[str, object]] = []
    with registered_page() as (words, ptr):
        for how in ("host_to_host", "via_gpu", "host_to_host", "via_gpu"):
            calls, early = [], 0
            for rep in range(5):
                words[0], src[0] = 0, rep + 1
                with torch.cuda.stream(stream):
                    big_dst.copy_(big_src, non_blocking=True)
                t0 = time.perf_counter()
                if how == "host_to_host":
                    check(rt.cudaMemcpyAsync(ptr, src.data_ptr(), 4, default, stream.cuda_stream), "h2h")
                else:
                    check(rt.cudaMemcpyAsync(dev.data_ptr(), src.data_ptr(), 4, default, stream.cuda_stream), "h2d")
                    check(rt.cudaMemcpyAsync(ptr, dev.data_ptr(), 4, default, stream.cuda_stream), "d2h")
                calls.append((time.perf_counter() - t0) * 1e3)
                early += int(words[0]) == rep + 1
                stream.synchronize()
                assert int(words[0]) == rep + 1
            rows.append({"how": how, "call_ms_median": round(statistics.median(calls), 3), "written_at_return": early})
            print(rows[-1], flush=True)
    write_result(args.json, args, rows)


if __name__ == "__main__":
    main()
