"""The worker daemon's own G2 -> G1 load path on a GPU, outside the daemon: where does a 20K-token
hit's copy time go, and does the host memory G2 lives in matter?

    python3 benchmarks/g2_copy_path.py [--blocks 1258] [--engine-blocks 1800] [--layers 36] [--groups 6]
                                       [--reps 5] [--json out.json]

Builds, for each kind of G2 memory, a :class:`~kvbm_worker.pools.HostPool` pinned by a
:class:`~kvbm_worker.handlers.cuda.CudaMover` (exactly as ``kvbm-worker --gpu 0`` does), and a
vLLM-like cross-layer KV cache on the GPU ([blocks, layers, 2, 16 tokens, 8 heads, 128] bf16,
Qwen3-4B's shape: 64 KiB pages, 2.25 MiB blocks). Then, alternating the kinds every repetition,
it times:

* ``one memcpy``: one ``cudaMemcpyAsync`` of the hit's bytes out of that pool (one per pinned
  registration it crosses, 1 GiB each): the DMA ceiling of that memory;
* ``mover, whole blocks``: ``BlockMover._engine_host`` of a LOAD (the lane's code of a ``sync`` /
  ``async`` load), the hit's blocks into scattered engine blocks;
* ``mover, N layer groups``: the same in layer groups (a ``layerwise`` load; the daemon's group
  shape, front-loaded since 2026-11-26, so the earlier files' first groups were larger ones), with
  each group's landing time (when the lane reported it) after the call started.

Kinds: ``shared`` (kvbm's G2: MAP_SHARED anonymous, 4 KiB pages), ``huge`` (an experiment, not a
kvbm option: private anonymous memory with MADV_HUGEPAGE, see :class:`HugePagePool`) and
``torch`` (torch's pinned allocator, cudaHostAlloc; memcpy only). Reports medians and how much
of each pool the kernel gave in huge pages.

Measured on an H100 (2026-11-25, ``results/g2_copy_path_h100_2026-11-25c.json``): all three
within 1 % of each other (one memcpy 54.4-55.0 ms; the lane's code 55.8-56.6 ms, first layer
group landed at 10.7 ms), so kvbm keeps 4 KiB shared pages. Inside the daemon, in the TTFT runs
of the same day, the same code took 58-82 ms and its first group landed at 21-39 ms after the
engine's call. ``--gap-s 0.5`` (the GPU idle before each copy, as between requests; fourth
session, ``results/g2_copy_path_h100_2026-11-25d_gap{0,0.5}.json``): medians 55.6 -> 59.7 ms, first
group 9.8 -> 11.2 ms, and two of five plain memcpys took 80 and 84 ms instead of 54 (the samples
are in the file).
"""
from __future__ import annotations

import argparse
import json
import mmap
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from provenance import provenance

from kvbm_client.ids import PlanKind
from kvbm_worker.cuda_region import CudaEngineRegion, check, cudart
from kvbm_worker.handlers.cuda import CudaMover
from kvbm_worker.id_arrays import EngineBlocks, Slots
from kvbm_worker.grouping import group_bounds
from kvbm_worker.mover import Grouping
from kvbm_worker.pools import HostPool, SlotGeometry

THP = Path("/sys/kernel/mm/transparent_hugepage")


class HugePagePool(HostPool):
    """A G2 pool in private anonymous memory advised for transparent huge pages (and kept out
    of any fork, as pinned memory must be)."""

    def __init__(self, geometry: SlotGeometry) -> None:
        self.geometry = geometry
        self._mmap = mmap.mmap(-1, geometry.total_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._mmap.madvise(mmap.MADV_DONTFORK)
        self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        self.slots = self.buffer.reshape(geometry.num_slots, geometry.slot_bytes)


def huge_bytes(address: int) -> int | None:
    """Bytes of the mapping at ``address`` in transparent huge pages (/proc/self/smaps)."""
    try:
        with open("/proc/self/smaps") as f:
            inside, total = False, 0
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    if inside:
                        return total
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:"):
                    total += int(line.split()[1]) * 1024
            return total if inside else None
    except (OSError, ValueError):
        return None


def thp_settings() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("enabled", "shmem_enabled", "defrag"):
        try:
            out[name] = (THP / name).read_text().strip()
        except OSError:
            out[name] = None
    return out


def memcpy_from(ptr: int, dev_ptr: int, nbytes: int, stream: torch.cuda.Stream, mover: CudaMover | None) -> float:
    """One cudaMemcpyAsync per pinned registration the range crosses (a DMA across two is pageable)."""
    rt = cudart()
    src, dst, n = np.array([ptr], np.int64), np.array([dev_ptr], np.int64), np.array([nbytes], np.int64)
    if mover is not None:
        src, dst, n = mover.pinned.split(src, dst, n, src)
    t = time.perf_counter()
    for s, d, k in zip(src.tolist(), dst.tolist(), n.tolist()):
        check(rt.cudaMemcpyAsync(d, s, k, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream.cuda_stream),
              "cudaMemcpyAsync")
    stream.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1258, help="blocks of the hit [1258: 20K tokens]")
    ap.add_argument("--engine-blocks", type=int, default=1800, help="blocks of the engine's cache [1800]")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--groups", type=int, default=6, help="layer groups of the layerwise way [6]")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kinds", default="shared,huge,torch")
    ap.add_argument("--gap-s", type=float, default=0.0,
                    help="idle seconds before every timed copy, as between a serving engine's requests "
                         "(0: back to back) [0]")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    record = provenance()
    kinds = args.kinds.split(",")
    kv = torch.zeros(args.engine_blocks, args.layers, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    page = 2 * 16 * 8 * 128 * 2
    region = CudaEngineRegion.from_local([kv], [(0, i * page, args.layers * page) for i in range(args.layers)],
                                         page, args.engine_blocks, "bfloat16")
    block = region.block_bytes
    nbytes = args.blocks * block
    geo = SlotGeometry.of(block, args.blocks + 8)
    blocks = EngineBlocks(np.random.default_rng(0).permutation(args.engine_blocks)[:args.blocks].astype(np.int64))
    slots = Slots(np.arange(4, 4 + args.blocks, dtype=np.int64))
    stream = torch.cuda.Stream()
    pools: dict[str, tuple[HostPool, CudaMover] | None] = {}
    huge: dict[str, int | None] = {}
    torch_host = None
    for kind in kinds:
        if kind == "torch":
            torch_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            torch_host.fill_(1)
            pools[kind] = None
            continue
        pool = HugePagePool(geo) if kind == "huge" else HostPool(geo)
        pool.commit()
        pool.slots[:, :block] = np.random.default_rng(1).integers(0, 255, block, dtype=np.uint8)
        huge[kind] = huge_bytes(pool.address)
        pools[kind] = (pool, CudaMover(pool, None, None, device=0))
    bounds = group_bounds(args.layers, args.groups)
    samples: dict[str, list[float]] = {}
    landed: dict[str, list[list[float]]] = {}

    def add(key: str, seconds: float) -> None:
        samples.setdefault(key, []).append(seconds * 1e3)

    for rep in range(args.reps + 1):  # repetition 0 warms up and is dropped
        for kind in kinds:
            entry = pools[kind]
            if entry is None:
                assert torch_host is not None
                src = torch_host.data_ptr()
            else:
                src = entry[0].address + 4 * geo.slot_bytes
            time.sleep(args.gap_s)
            ms = memcpy_from(src, kv.data_ptr(), nbytes, stream, None if entry is None else entry[1])
            if rep:
                add(f"{kind}: one memcpy", ms)
            if entry is None:
                continue
            mover = entry[1]
            time.sleep(args.gap_s)
            t = time.perf_counter()
            mover._engine_host(PlanKind.LOAD, region, blocks, slots, time.monotonic() + 60)
            if rep:
                add(f"{kind}: mover, whole blocks", time.perf_counter() - t)
            marks: list[float] = []
            time.sleep(args.gap_s)
            t = time.perf_counter()
            mover._engine_host(PlanKind.LOAD, region, blocks, slots, time.monotonic() + 60,
                               Grouping(bounds, lambda end: marks.append((time.perf_counter() - t) * 1e3)))
            if rep:
                add(f"{kind}: mover, {args.groups} layer groups", time.perf_counter() - t)
                landed.setdefault(kind, []).append(marks)
    last = [k for k in kinds if pools[k] is not None][-1]
    pools[last][1]._engine_host(PlanKind.LOAD, region, blocks, slots, time.monotonic() + 60)  # type: ignore[index]
    torch.cuda.synchronize()
    got = kv[int(blocks[3])].reshape(-1).view(torch.uint8)[:4096].cpu().numpy()
    assert np.array_equal(got, pools[last][0].slots[7, :4096]), "the mover copied wrong bytes"  # type: ignore[index]
    rows = [{"way": k, "ms": round(statistics.median(v), 2), "GB_s": round(nbytes / statistics.median(v) / 1e6, 1),
             "samples_ms": [round(x, 2) for x in v]} for k, v in samples.items()]
    groups = {k: [round(statistics.median(m[i] for m in v), 2) for i in range(len(bounds))] for k, v in landed.items()}
    summary = {"provenance": record, "bytes": nbytes, "blocks": args.blocks, "block_bytes": block,
               "page_bytes": page, "slot_bytes": geo.slot_bytes, "device": torch.cuda.get_device_name(0),
               "thp": thp_settings(), "huge_bytes": huge, "rows": rows, "landed_ms_median": groups}
    for r in rows:
        print(f"{r['way']:<40} {r['ms']:8.2f} ms {r['GB_s']:6.1f} GB/s  "
              f"(samples {min(r['samples_ms']):.1f}-{max(r['samples_ms']):.1f} ms)")  # a median hides slow copies
    print(json.dumps({k: v for k, v in summary.items() if k not in ("provenance", "rows")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    for entry in pools.values():
        if entry is not None:
            entry[1].close()
            entry[0].close()


if __name__ == "__main__":
    main()
