"""Does a small host -> GPU upload on a stream of its own wait for the big copies queued before it
on another stream? (A staged load's scatter uploads its block indices once the blocks are known,
while the stage's copies of the whole hit, ~2.9 GB, are queued on the load stream.)

    python3 benchmarks/upload_behind_copies.py [--gb 2.9] [--chunk-mib 8] [--after-ms 5] [--reps 3]
                                               [--json out.json]

Why: on an H100 (twenty-sixth session, commit 20ebfb7, 20K with CUDA graphs, every layer group of
the hit staged) a staged load's first group reached the engine 7-9 ms after its own staging copies
could have landed, while its last group landed at the link's pace; the scatter of the first group
waits for its index upload (``kvbm_worker/handlers/cuda_stage.py``), issued after every staging
copy. This times, on the GPU's clock from the first queued copy: the end of the queued copies, and
an upload of ``n`` int64 indices issued ``--after-ms`` later on another stream, three ways:
``pinned`` (``pin_memory().to(non_blocking=True)``, as the stage does), ``pageable`` (a plain
``.to()`` from pageable memory) and ``kernel`` (the pinned buffer seen at its own address through
``__cuda_array_interface__`` and cloned; NOTE: a clone of a contiguous tensor is a
``cudaMemcpyAsync``, so this too is copy-engine work, not an SM read of mapped memory as first
meant); and ``compute``, a kernel that reads no host memory (``torch.arange`` on the device: does
any work on another stream wait behind the copies?). Medians over ``--reps``.

H200 "e" (twenty-sixth session, ``results/upload_behind_copies_h200_2026-11-28e.json``, before
``compute`` existed): every upload landed with the copies' end (53.65 / 53.76 / 53.74 ms against
53.64 / 53.76 / 53.73).
H100 "f" (twenty-seventh session, ``results/upload_behind_copies_h100_2026-11-28f.json``): the
``compute`` kernel ran beside the copies (it ended 5.79 ms after the first, against 53.96 ms for
the copies); ``pinned``, ``pageable`` and ``kernel`` each ended with the copies (54.00 / 53.99 /
53.91 against 53.99 / 53.98 / 53.90). So only copy-engine work waits behind queued copies; a
scatter given its indices without a copy (as a kernel's parameters) would not. Not pursued: a
staged load keeps the host link busy from the stage's arrival to its last group (56.4 ms for a
20K hit's 2.97 GB on that lease, 52.8 GB/s against one memcpy's 54.8), so staging more groups
could not land the last one sooner (``kvbm_worker/stages.py``, ``MAX_STAGED_GROUPS``).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_bench import write_result


def one(h: Any, d: Any, chunk: int, after_ms: float, way: str, n: int) -> dict[str, float]:
    load, side = torch.cuda.Stream(), torch.cuda.Stream()
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    start, end, up = ev(), ev(), ev()
    values = np.arange(n, dtype=np.int64)[::-1].copy()
    mapped = torch.from_numpy(values).pin_memory() if way == "kernel" else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(load):
        start.record()
        for lo in range(0, h.numel(), chunk):
            d[lo:lo + chunk].copy_(h[lo:lo + chunk], non_blocking=True)
        end.record()
    while (time.perf_counter() - t0) * 1e3 < after_ms:
        time.sleep(0.0002)
    with torch.cuda.stream(side):
        if way == "compute":
            idx = torch.arange(n - 1, -1, -1, dtype=torch.int64, device="cuda")
        elif way == "pinned":
            idx = torch.from_numpy(values).pin_memory().to("cuda", non_blocking=True)
        elif way == "pageable":
            idx = torch.from_numpy(values).to("cuda", non_blocking=True)
        else:  # UVA: the pinned buffer's own address, read by an SM copy
            assert mapped is not None
            view = torch.as_tensor(_Cai(mapped.data_ptr(), n), device="cuda")
            idx = view.clone()
        up.record()
    torch.cuda.synchronize()
    assert torch.equal(idx.cpu(), torch.from_numpy(values)), "the upload's values"
    return {"copies_ms": start.elapsed_time(end), "upload_ms": start.elapsed_time(up)}


class _Cai:
    """An int64 vector at a device-visible address (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i8", "data": (ptr, False), "version": 3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.9)
    ap.add_argument("--chunk-mib", type=float, default=8.0)
    ap.add_argument("--after-ms", type=float, default=5.0)
    ap.add_argument("--indices", type=int, default=1268 * 11)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    nbytes = int(args.gb * 1e9)
    h = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    chunk = int(args.chunk_mib * (1 << 20))
    rows = []
    for way in ("compute", "pinned", "pageable", "kernel"):
        try:
            runs = [one(h, d, chunk, args.after_ms, way, args.indices) for _ in range(args.reps)]
        except Exception as exc:  # noqa: BLE001 - a way this torch or driver refuses: said in the row
            rows.append({"way": way, "error": repr(exc)})
            print(rows[-1], flush=True)
            continue
        row = {"way": way, **{k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}}
        rows.append(row)
        print(row, flush=True)
    write_result(args.json, args, rows)


if __name__ == "__main__":
    main()
