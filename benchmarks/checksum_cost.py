"""CPU cost of the worker's slot checksums (``kvbm_worker.checksums.digest``: xxh3-64 per slot),
beside a memcpy of the same bytes, on one core.

Prints one JSON object (commit, argv, machine, medians of 5 alternating passes over 1 GiB per
slot size). ``python benchmarks/checksum_cost.py``
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

from kvbm_worker.checksums import digest

GIB = 1 << 30
SLOT_SIZES = (8 << 10, 256 << 10, 2304 << 10)  # the CPU tests' block, a mid-size block, a vLLM GPU block


def measure(slot: int, passes: int = 5) -> dict[str, float]:
    n = GIB // slot
    rows = np.random.default_rng(0).integers(0, 256, (n, slot), dtype=np.uint8)
    dst = np.empty_like(rows)
    picks = np.arange(n, dtype=np.int64)
    checksum, memcpy = [], []
    for _ in range(passes):  # alternating, so both see the same machine state
        t = time.perf_counter()
        digest(rows, picks, slot)
        checksum.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(dst, rows)
        memcpy.append(time.perf_counter() - t)
    ck, cp = statistics.median(checksum), statistics.median(memcpy)
    return {"slot_bytes": slot, "checksum_s_per_GiB": round(ck, 4), "checksum_GBps": round(GIB / ck / 1e9, 2),
            "memcpy_s_per_GiB": round(cp, 4), "memcpy_GBps": round(GIB / cp / 1e9, 2)}


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    print(json.dumps({"commit": commit, "argv": sys.argv, "machine": f"{platform.machine()} {cpu}, "
                      f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
                      "results": [measure(s) for s in SLOT_SIZES]}, indent=1))


if __name__ == "__main__":
    main()
