"""The shared parts of benchmarks/gpu_transfer.py: the engine-side KV cache it moves, how it
times and records, and its matmul "engine".

* The KV cache: a vLLM-like layout (16 tokens, 36 layers, 8 KV heads, head dim 128, bf16: 2.25 MiB
  per block) in either the cross-layer or the per-layer form; ``block_ref`` reads one block's bytes
  back for the byte-equality checks, and ``memcpy_reference`` times the one-shot pinned memcpy every
  copy path is compared against.
* Recording: ``median_time`` of a callable, ``emit`` of a result row (printed at once and kept in
  ``OUT``) and ``write_rows``, which writes the provenance header and every kept row as JSON lines.
* The matmul "engine": a bf16 matmul loop in a separate process. ``matmul_child`` is that
  process's body (``gpu_transfer.py --matmul-child`` runs it); ``Matmul`` starts it and measures its
  TFLOP/s alone and with copy traffic running in this process's threads.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

TOKENS, LAYERS, HEADS, DIM = 16, 36, 8, 128
BLOCK_BYTES = LAYERS * 2 * TOKENS * HEADS * DIM * 2
G1_BLOCKS = 2600
SIZES = (1, 16, 128, 256, 512, 1250)


def make_kv(layout: str, n: int = G1_BLOCKS):
    import torch
    if layout == "cross":
        kv = [torch.empty(n, LAYERS, 2, TOKENS, HEADS, DIM, dtype=torch.bfloat16, device="cuda")]
    else:
        kv = [torch.empty(2, n, TOKENS, HEADS, DIM, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    for t in kv:
        t.view(torch.uint8).random_(0, 256)
    torch.cuda.synchronize()
    return kv


def block_ref(kv, layout: str, b: int):
    import torch
    if layout == "cross":
        return kv[0][b].reshape(-1).view(torch.uint8)
    return torch.cat([t[k, b].reshape(-1).view(torch.uint8) for t in kv for k in range(2)])


def memcpy_reference(nbytes: int, dev_flat, host_flat) -> tuple[float, float]:
    """One-shot pinned memcpy of ``nbytes`` (median of 5, CUDA events): (d2h s, h2d s)."""
    import torch
    out = []
    for direction in ("d2h", "h2d"):
        ts = []
        for _ in range(6):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            if direction == "d2h":
                host_flat[:nbytes].copy_(dev_flat[:nbytes], non_blocking=True)
            else:
                dev_flat[:nbytes].copy_(host_flat[:nbytes], non_blocking=True)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        out.append(statistics.median(ts[1:]))
    return out[0], out[1]


OUT: list[dict] = []


def emit(**kw) -> dict:
    OUT.append(kw)
    print(json.dumps(kw), flush=True)
    return kw


def median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def write_rows(path: str, header: str) -> None:
    with open(path, "w") as f:
        f.write(header)
        for row in OUT:
            f.write(json.dumps(row) + "\n")


ENTRY = Path(__file__).resolve().with_name("gpu_transfer.py")  # whose --matmul-child runs matmul_child


def matmul_child() -> None:
    """Stand-in for the engine's kernels: answers 'measure SECONDS' with TFLOP/s."""
    import torch
    n = 8192
    a, b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda"), torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    for _ in range(20):
        torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    print("ready", flush=True)
    for line in sys.stdin:
        seconds = float(line.split()[1])
        torch.cuda.synchronize()
        t0, it = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                torch.mm(a, b, out=c)
            torch.cuda.synchronize()
            it += 10
        dt = time.perf_counter() - t0
        print(json.dumps({"tflops": it * 2 * n ** 3 / dt / 1e12}), flush=True)


class Matmul:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ENTRY), "--matmul-child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def measure(self, seconds: float) -> float:
        self.proc.stdin.write(f"measure {seconds}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["tflops"]

    def with_traffic(self, traffic, seconds: float = 3.0) -> dict:
        """Baseline, then with ``traffic(stop_event) -> bytes`` running in threads, then baseline."""
        base1 = self.measure(seconds)
        stop, moved = threading.Event(), []
        threads = [threading.Thread(target=lambda f=f: moved.append(f(stop))) for f in traffic]
        for t in threads:
            t.start()
        time.sleep(0.3)
        t0 = time.perf_counter()
        loaded = self.measure(seconds)
        stop.set()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        base2 = self.measure(seconds)
        base = (base1 + base2) / 2
        return {"baseline_tflops": round(base, 1), "loaded_tflops": round(loaded, 1),
                "slowdown_pct": round(100 * (1 - loaded / base), 2), "traffic_GBps": round(sum(moved) / elapsed / 1e9, 1)}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)
