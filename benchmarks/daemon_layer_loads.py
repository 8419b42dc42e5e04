"""Layer-grouped loads through the real daemons on a GPU, without an engine: is a load slow
inside the worker daemon, or only beside vLLM?

    python3 benchmarks/daemon_layer_loads.py [--blocks 1258] [--groups 6] [--reps 12] [--gap-ms 150]
        [--busy] [--hog N] [--variant NAME=WORKER_FLAGS ...] [--passes 2] [--g2-gb 12]
        [--layout cross-layer|per-layer] [--stores-beside] [--json out.json]

This process plays the engine: a vLLM-like cross-layer KV cache on the GPU ([blocks, 36 layers, 2,
16 tokens, 8 heads, 128] bf16, Qwen3-4B's shape: 2.25 MiB blocks) exported through CUDA IPC to a
``kvbm-worker --gpu 0`` of a real node (leader and worker as child processes, the worker at
``DYN_LOG=debug``). ``--layout per-layer`` instead gives each layer its own allocation
([blocks, 16 tokens, 8 heads, 2 x 128] bf16: one 64 KiB page per block and layer), as vLLM 0.26's V2
model runner allocates Qwen3's KV cache (the harness's engine): a block's pages are then 36 copies,
where the cross-layer buffer's merge into one. It stores ``--blocks`` blocks, then ``--reps`` times: looks the prefix up
(``PrepareLoad``) and loads it into other blocks with ``TransferLayers`` in ``--groups`` layer
groups (the connector's ``layerwise`` load), ``--gap-ms`` apart (the GPU idle in between, as between
requests). ``--busy``: a bf16 matmul loop runs on this process's GPU context during every load (the
engine's forward beside the copy: the daemon's copies and the engine's kernels are two contexts).
``--stores-beside``: each load starts ``--store-lead-ms`` after a store of ``--blocks`` fresh keys
from the source blocks (a cold request offloading while a warm one loads: the two copy lanes of one
worker; the store's time is recorded too). Use ``--g2-gb`` above (reps + 1) x the blocks' bytes so
that no stored block is evicted.

Per load it records, from this side, when each group's pages were reported landed (ms after the
``TransferLayers`` call was sent) and, from the worker's debug line, each piece's issue began / issued
/ landed times on the lane and when it landed by the GPU's clock. Reports per variant: medians of
the first and last group's landing, of the worker's lane and GPU times, and of the issue cost.

Variants (``--variant NAME=FLAGS``, the worker's extra flags; default one, ``default=``) run in
alternating passes (A B A B), each on a freshly started node.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gpu_bench import Hogs
from lane_issue import analyse, job_rows, summarize
from provenance import provenance

from kvbm_client import KvbmClient
from kvbm_client.channels import open_channel
from kvbm_client.connectors.core.layerwise import LayerwiseCall
from kvbm_client.contract import pb, rpc
from kvbm_client.cuda_export import export_kv_cache
from kvbm_client.local_node import LocalNode, isolated_env
from kvbm_worker.grouping import GroupPacing

ROOT = Path(__file__).resolve().parents[1]
LAYERS, TOKENS, HEADS, DIM = 36, 16, 8, 128
#: pages per block in the region each layout exports (cross-layer: a page is one layer's K or V)
PAGES = {"cross-layer": 2 * LAYERS, "per-layer": LAYERS}


def med(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


class Busy:
    """A bf16 matmul loop on this process's GPU context, on while ``on`` is set."""

    def __init__(self) -> None:
        import torch
        self.on = threading.Event()
        self.stop = threading.Event()
        self.a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
        self.launched = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import torch
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not self.stop.is_set():
                if not self.on.wait(0.05):
                    continue
                for _ in range(8):
                    torch.mm(self.a, self.a)
                    self.launched += 1
                stream.synchronize()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def daemon_rows(log: Path) -> list[dict]:
    """The worker's debug line of each layer-grouped load, parsed."""
    return job_rows(log.read_text(errors="replace"))


def timed_store(client: KvbmClient, keys: list[bytes], blocks: list[int]) -> float:
    """Offload ``blocks`` under ``keys`` and wait for it: ms."""
    t = time.perf_counter()
    client.wait(client.offload(keys, blocks))
    return round((time.perf_counter() - t) * 1e3, 2)


def make_kv(n: int, layout: str) -> list:
    """The engine's KV cache for ``n`` blocks (and ``n`` more to load into): one cross-layer tensor, or
    one tensor per layer (``per-layer``, each its own allocation), random bytes."""
    import torch
    if layout == "per-layer":
        kv = [torch.empty(2 * n + 8, TOKENS, HEADS, 2 * DIM, dtype=torch.bfloat16, device="cuda")
              for _ in range(LAYERS)]
    else:
        kv = [torch.empty(2 * n + 8, LAYERS, 2, TOKENS, HEADS, DIM, dtype=torch.bfloat16, device="cuda")]
    for t in kv:
        t.view(torch.uint8).random_(0, 256)
    return kv


def one_variant(name: str, flags: list[str], kv: list, args: argparse.Namespace, busy: Busy | None) -> dict:
    import torch
    n = args.blocks
    with tempfile.TemporaryDirectory(prefix="kvbm-layer-loads-", dir="/tmp") as tmp:
        root = Path(tmp)
        env = isolated_env(root, {"DYN_LOG": "debug", "DYN_KVBM_CPU_CACHE_GB": args.g2_gb,
                                  "DYN_KVBM_HOST_FREE_WATERMARK": "0", "DYN_KVBM_JOB_TIMEOUT_SECS": "60"})
        node = LocalNode(env, gpus=[0], worker_args=["--no-nixl", *flags], log_dir=root, cwd=ROOT)
        node.start(timeout=300.0)
        client = KvbmClient(node.config(), timeout=60)
        readers = ThreadPoolExecutor(4)
        storer = ThreadPoolExecutor(1) if args.stores_beside else None
        channel = None
        try:
            region_id = client.register_region("0", export_kv_cache(kv if len(kv) > 1 else kv[0], block_dim=0))
            client.wait_ready(600)
            keys = [os.urandom(16) for _ in range(n)]
            src, dst = list(range(n)), list(range(n, 2 * n))
            torch.cuda.synchronize()
            client.wait(client.offload(keys, src))
            channel = open_channel(node.worker_address("0"), node.config())
            stub = rpc.WorkerStub(channel)
            loads = []
            for rep in range(args.reps):
                time.sleep(args.gap_ms / 1e3)
                for layer in kv:
                    layer[n:2 * n].zero_()
                torch.cuda.synchronize()
                store = None
                if storer is not None:
                    store = storer.submit(timed_store, client, [os.urandom(16) for _ in range(n)], src)
                    time.sleep(args.store_lead_ms / 1e3)
                t = time.perf_counter()
                handle = client.prepare_load(keys)
                lookup = time.perf_counter() - t
                assert handle.num_blocks == n, f"matched {handle.num_blocks} of {n}"
                if busy is not None:
                    busy.on.set()
                sent = time.monotonic()
                call = LayerwiseCall(stub.TransferLayers(pb.TransferRequest(
                    region_id=region_id, plan=handle.signed, engine_blocks=dst, sent_at=time.time(),
                    layer_groups=args.groups), timeout=60), readers)
                answer = call.result(60)
                done = time.monotonic()
                if busy is not None:
                    busy.on.clear()
                landed = [round((t - sent) * 1e3, 2) for t, _ in call.landings]
                loads.append({"rep": rep, "lookup_ms": round(lookup * 1e3, 2), "landed_ms": landed,
                              "done_ms": round((done - sent) * 1e3, 2),
                              "daemon_lane_ms": round(answer.seconds * 1e3, 2),
                              "store_ms": None if store is None else store.result(120)})
            step = max(1, n // 64)  # (compared as bytes: random bf16 bytes hold NaNs, which never equal)
            equal = all(bool(torch.equal(t[n:2 * n:step].view(torch.uint8), t[0:n:step].view(torch.uint8)))
                        for t in kv)
        finally:
            if channel is not None:
                channel.close()
            readers.shutdown()
            if storer is not None:
                storer.shutdown()
            client.close()
            node.stop(30.0)
        rows = daemon_rows(root / "worker-0.log")
    warm = loads[1:]  # the first load pays first-use costs
    jobs = rows[1:]
    return {
        "variant": name, "flags": flags, "bytes_equal": equal, "loads": loads, "daemon": rows,
        "first_group_ms": med([x["landed_ms"][0] for x in warm if x["landed_ms"]]),
        "last_group_ms": med([x["landed_ms"][-1] for x in warm if x["landed_ms"]]),
        "done_ms": med([x["done_ms"] for x in warm]),
        "store_ms": med([x["store_ms"] for x in warm if x["store_ms"] is not None]),
        "lane_ms": med([j["lane_ms"] for j in jobs]),
        "lane_first_group_ms": med([j["groups_lane"][0] for j in jobs if j["groups_lane"]]),
        "gpu_first_piece_ms": med([j["gpu_landed"][0] for j in jobs if j["gpu_landed"]]),
        "gpu_last_piece_ms": med([j["gpu_landed"][-1] for j in jobs if j["gpu_landed"]]),
        "first_issue_began_ms": med([j["first_issue_began"] for j in jobs if j["first_issue_began"] is not None]),
        "issue_ms_median": med([v for j in jobs for v in j["issue_ms"]]),
        "issue_ms_max": max((v for j in jobs for v in j["issue_ms"]), default=None),
        "issue_cpu_ms_median": med([v for j in jobs for v in j["issue_cpu_ms"]]),
        # per load: issue rate (bytes / lane CPU), idle copy engine, ... (lane_issue.py; the cut the
        # worker's defaults make: None where a variant's flags cut the pieces otherwise)
        "lane": summarize([analyse(j, PAGES[args.layout], GroupPacing()) for j in jobs]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1258)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--gap-ms", type=float, default=150.0)
    ap.add_argument("--busy", action="store_true", help="a matmul loop on this process's GPU during every load")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="a worker configuration (its extra flags); repeat; default: one, 'default='")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--g2-gb", type=float, default=12.0)
    ap.add_argument("--hog", type=int, default=0, help="this many processes spin on the CPU throughout")
    ap.add_argument("--layout", choices=sorted(PAGES), default="cross-layer",
                    help="the engine's KV cache: one cross-layer tensor (vLLM's V1 runner with a connector that "
                         "prefers it) or one allocation per layer (the V2 runner, vLLM 0.26's default for Qwen3)")
    ap.add_argument("--stores-beside", action="store_true",
                    help="each load starts --store-lead-ms after a store of --blocks fresh keys begins")
    ap.add_argument("--store-lead-ms", type=float, default=5.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    hogs = Hogs(args.hog)
    import torch
    variants = [(v.split("=", 1)[0], shlex.split(v.split("=", 1)[1] if "=" in v else "")) for v in args.variant] \
        or [("default", [])]
    n = args.blocks
    kv = make_kv(n, args.layout)
    torch.cuda.synchronize()
    busy = Busy() if args.busy else None
    results = []
    try:
        for p in range(args.passes):
            for name, flags in variants:
                r = one_variant(name, flags, kv, args, busy)
                r["pass"] = p
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("loads", "daemon")}), flush=True)
    finally:
        hogs.close()
        if busy is not None:
            busy.close()
    summary = {}
    for name, _ in variants:
        mine = [r for r in results if r["variant"] == name]
        summary[name] = {k: med([r[k] for r in mine if r[k] is not None])
                         for k in ("first_group_ms", "last_group_ms", "done_ms", "store_ms", "lane_ms",
                                   "lane_first_group_ms", "gpu_first_piece_ms", "gpu_last_piece_ms",
                                   "first_issue_began_ms", "issue_ms_median", "issue_cpu_ms_median")}
        summary[name]["per_pass_last_group_ms"] = [r["last_group_ms"] for r in mine]
        summary[name]["bytes_equal"] = all(r["bytes_equal"] for r in mine)
    print(json.dumps({"summary": summary}, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"provenance": provenance(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "block_bytes": LAYERS * 2 * TOKENS * HEADS * DIM * 2,
                                         "summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
