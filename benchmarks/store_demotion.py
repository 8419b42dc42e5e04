"""What a store into a full G2 costs when the blocks it evicts go to G3 inside its own plan
(``DYN_KVBM_STORE_DEMOTION_MB``), on the real daemons and this machine's disk.

A node (leader + one worker, child processes) with G2 = N blocks and G3 = 4N, the disk offload
filter off and no background demotion (``DYN_KVBM_HOST_FREE_WATERMARK=0``), blocks shaped like
Qwen3-4B's (36 layers x 64 KiB = 2.36 MB). Store 1 fills G2; store 2 (N new blocks) evicts all
of them: with ``-1`` (no limit) every victim is written to G3 before store 2 completes, with the
default 64 MB only that much. The figure is store 2's time from the offload call to its
completion, i.e. how long an engine's blocks stay held. Alternating passes, a fresh node each,
medians.

``python benchmarks/store_demotion.py --dir /var/tmp --out benchmarks/results/store_demotion_cpu.json``
(``--dir``: where G3 goes, i.e. the disk measured).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402

from kvbm_client import KvbmClient, ShmKvBuffer, sequence_hashes  # noqa: E402
from kvbm_client.local_node import READY_TIMEOUT, LocalNode, isolated_env  # noqa: E402

LAYERS, PAGE = 36, 65536


def one_pass(limit_mb: str, blocks: int, root: Path) -> dict[str, Any]:
    env = isolated_env(root, {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": blocks,
                              "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 4 * blocks,
                              "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
                              "DYN_KVBM_HOST_FREE_WATERMARK": "0", "DYN_KVBM_STORE_DEMOTION_MB": limit_mb})
    node = LocalNode(env, 1, log_dir=root).start()
    engine = ShmKvBuffer(2 * blocks, LAYERS, PAGE, directory=str(root))
    client = KvbmClient(node.config(), client_name="bench")
    try:
        engine.array[:] = 7
        client.register_region("0", engine.spec())
        client.wait_ready(READY_TIMEOUT)
        keys = sequence_hashes(list(range(2 * blocks * 16)), 16)
        t0 = time.perf_counter()
        client.wait(client.offload(keys[:blocks], list(range(blocks))))
        fill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        handle = client.offload(keys[blocks:], list(range(blocks, 2 * blocks)))
        client.wait(handle)
        evicting_s = time.perf_counter() - t0
        counters = node.status().counters
        return {"limit_mb": limit_mb, "fill_store_s": round(fill_s, 4), "evicting_store_s": round(evicting_s, 4),
                "demoted_blocks": counters["kvbm_offload_blocks_h2d"],
                "skipped_demotions": counters["kvbm_offload_skipped_demotions"],
                "block_bytes": LAYERS * PAGE}
    finally:
        client.close()
        node.stop()
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=256, help="G2 size and store size, blocks of 2.36 MB")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--limits", default="-1,64", help="DYN_KVBM_STORE_DEMOTION_MB values, alternated")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the node's files (G3) go")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for p in range(args.passes):
        for limit in args.limits.split(","):
            with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvbm-sd-") as d:
                row = one_pass(limit, args.blocks, Path(d)) | {"pass": p}
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {}
    for limit in args.limits.split(","):
        mine = [r for r in rows if r["limit_mb"] == limit]
        summary[limit] = {"evicting_store_s_median": statistics.median(r["evicting_store_s"] for r in mine),
                          "fill_store_s_median": statistics.median(r["fill_store_s"] for r in mine),
                          "evicting_store_s_passes": [r["evicting_store_s"] for r in mine],
                          "demoted_blocks": [r["demoted_blocks"] for r in mine]}
    print(json.dumps({"summary": summary}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"provenance": provenance(), "rows": rows, "summary": summary},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
