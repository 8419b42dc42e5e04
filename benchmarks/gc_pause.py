"""How long one full garbage collection holds the leader's event loop, against how many blocks
its registry holds: Python's cyclic collector traverses every object it tracks at every
generation-2 collection, which runs on the loop's thread when enough objects were created since
the last (CPython's "long-lived pending > 25 %" rule), whatever request is in flight. Until
b87f67f each block was three such objects (a ``BlockEntry``, its ``copies`` dict, a ``TierCopy``;
``results/gc_pause_cpu_2026-11-26.json``); since, none (the registry's dicts hold only bytes,
ints and None): what is left grows with the entries of each tier's LRU and of the disk offload
filter's table, two ``OrderedDict`` objects the collector walks entry by entry
(``results/gc_pause_cpu_2026-11-26b.json``).

    python3 benchmarks/gc_pause.py [--blocks 65536,262144,1048576] [--reps 5] [--json out.json]

Per size: a fresh :class:`~kvbm_leader.placement.PlacementPolicy` with a G2 of that many blocks,
filled by 1024-block stores committed as the leader does (plus the filter's entries), then
``gc.collect()`` timed ``--reps`` times: the median and the max, and the same after
``gc.freeze()`` of everything that existed before the registry was filled (the interpreter's and
the libraries' objects, what a daemon could freeze once at start-up). Pure Python, in process;
no daemon, no GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

from provenance import provenance

from kvbm_client.ids import BlockHash, JobId, Tier
from kvbm_leader.placement import PlacementPolicy
from kvbm_leader.policies.frequency import FrequencyFilter

import grpc  # noqa: F401  (what the daemon has loaded: part of the heap a collection traverses)
from kvbm_client.contract import pb  # noqa: F401


def fill(blocks: int) -> PlacementPolicy:
    policy = PlacementPolicy({Tier.HOST: blocks}, FrequencyFilter(max_entries=1_000_000))
    for start in range(0, blocks, 1024):
        keys = [BlockHash(i.to_bytes(16, "big")) for i in range(start, min(blocks, start + 1024))]
        plan = policy.prepare_store(JobId(start // 1024 + 1), keys)
        policy.complete(plan, True)
    return policy


def timed_collections(reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="65536,262144,1048576", help="registry sizes, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="timed collections per size and mode [5]")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    record = provenance()
    rows = []
    for blocks in (int(b) for b in args.blocks.split(",")):
        for frozen in (False, True):
            gc.collect()
            if frozen:
                gc.freeze()  # what existed before the registry: the interpreter's and libraries' objects
            policy = fill(blocks)
            tracked = len(gc.get_objects())
            ms = timed_collections(args.reps)
            row = {"blocks": blocks, "startup_frozen": frozen, "tracked_objects": tracked,
                   "collect_ms_median": round(statistics.median(ms), 2), "collect_ms_max": round(max(ms), 2),
                   "collect_ms": [round(x, 2) for x in ms]}
            rows.append(row)
            print(f"{blocks:>8} blocks, start-up {'frozen' if frozen else 'not frozen'}: {tracked} tracked objects, "
                  f"gc.collect() median {row['collect_ms_median']} ms, max {row['collect_ms_max']} ms", flush=True)
            del policy
            gc.unfreeze()
            gc.collect()
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": record, "reps": args.reps, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
