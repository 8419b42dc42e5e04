"""Control-plane and CPU data-path benchmark of a real node (leader + worker child processes).

Prints, from one run:
  * gRPC round trip p50/p99 (leader KeepAlive over its unix socket);
  * leader match ops/s (sequential and 32 in flight), offload cycles/s (prepare + worker copy +
    commit, 1-block batches), blocks/s for 64-block batches;
  * CPU copy bandwidth through the worker (offload engine->G2 and onboard G2->engine) as a ratio
    to a plain numpy memcpy of the same bytes in the same run.

    python benchmarks/control_plane.py [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from provenance import provenance

from kvbm_client import AsyncKvbmClient, KvbmConfig, ShmKvBuffer, sequence_hashes
from kvbm_client.contract import pb
from kvbm_client.local_node import LocalNode, isolated_env


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def node(root: Path, host_blocks: int) -> LocalNode:
    """A leader and one CPU worker, logs in ``root``."""
    env = isolated_env(root, {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": host_blocks, "DYN_LOG": "warning",
                              "DYN_KVBM_HOST_FREE_WATERMARK": "0"})
    return LocalNode(env, 1, log_dir=root)


async def bench(env: dict, root: Path, args) -> dict:
    cfg = KvbmConfig.from_env(env)
    client = await AsyncKvbmClient.connect(cfg, timeout=30)
    layers, page = args.layers, args.page_kib * 1024
    engine = ShmKvBuffer(args.blocks * 2, layers, page, directory=str(root))
    engine.array[:] = np.random.default_rng(0).integers(0, 256, engine.array.shape, dtype=np.uint8)
    await client.register_region("0", engine.spec())
    await client.wait_ready(60)
    out: dict = {"layout": {"layers": layers, "page_bytes": page, "block_bytes": layers * page}}

    # 1. round trip
    lat = []
    for _ in range(args.n):
        t = time.perf_counter()
        await client._leader_call("KeepAlive", pb.KeepAliveRequest(session_id=client.session_id))
        lat.append(time.perf_counter() - t)
    out["rtt_ms"] = {"p50": pct(lat, 0.5) * 1e3, "p99": pct(lat, 0.99) * 1e3}

    # 2. match ops/s
    keys = sequence_hashes(list(range(32 * 16)), 16)
    await client.wait(await client.offload(keys[:16], list(range(16))))
    t = time.perf_counter()
    for _ in range(args.n):
        await client.match(keys, count_hit=False)
    out["match_ops_s_sequential"] = args.n / (time.perf_counter() - t)
    t = time.perf_counter()
    sem = asyncio.Semaphore(32)

    async def one() -> None:
        async with sem:
            await client.match(keys, count_hit=False)
    await asyncio.gather(*(one() for _ in range(args.n)))
    out["match_ops_s_32_in_flight"] = args.n / (time.perf_counter() - t)

    # 3. offload cycles (prepare + copy + commit), 1-block batches, small blocks dominate nothing
    n_cycles = min(args.n, args.host_blocks - 64)
    fresh = sequence_hashes(list(range(10_000_000, 10_000_000 + n_cycles * 16)), 16)
    t = time.perf_counter()
    for i in range(n_cycles):
        await client.wait(await client.offload([fresh[i]], [i % args.blocks]))
    out["offload_cycles_s_1_block"] = n_cycles / (time.perf_counter() - t)

    # 4. bandwidth: one batch of args.blocks blocks, offload then onboard, vs memcpy
    big = sequence_hashes(list(range(20_000_000, 20_000_000 + args.blocks * 16)), 16)
    src, dst = list(range(args.blocks)), list(range(args.blocks, 2 * args.blocks))
    nbytes = args.blocks * layers * page
    off, on, cp = [], [], []
    for rep in range(args.reps):
        keys_rep = sequence_hashes(list(range(30_000_000 + rep * 10_000_000,
                                              30_000_000 + rep * 10_000_000 + args.blocks * 16)), 16)
        t = time.perf_counter()
        await client.wait(await client.offload(keys_rep, src))
        off.append(time.perf_counter() - t)
        t = time.perf_counter()
        await client.wait(await client.onboard(keys_rep, dst))
        on.append(time.perf_counter() - t)
        a = np.empty(nbytes, np.uint8)
        b = engine.array[:args.blocks].reshape(-1)
        t = time.perf_counter()
        np.copyto(a, b)
        cp.append(time.perf_counter() - t)
        assert np.array_equal(engine.array[dst], engine.array[src])
    del big
    best = lambda xs: min(xs)
    out["copy"] = {"bytes": nbytes, "memcpy_GBps": nbytes / best(cp) / 1e9,
                   "offload_GBps": nbytes / best(off) / 1e9, "onboard_GBps": nbytes / best(on) / 1e9,
                   "offload_ratio_to_memcpy": best(cp) / best(off), "onboard_ratio_to_memcpy": best(cp) / best(on)}
    await client.close()
    engine.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000, help="operations per latency/ops test")
    parser.add_argument("--blocks", type=int, default=256, help="blocks in the bandwidth batch")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--page-kib", type=int, default=16, help="bytes per block per layer, KiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--stall-passes", type=int, default=1,
                        help="passes of the leader-stall benchmark (benchmarks/leader_stall.py: a 65536-key "
                             "PrepareStore into a full G2 while another client's KeepAlives are timed); 0 skips it")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    args.host_blocks = max(args.n + 64, args.blocks * (args.reps + 1) + 64)
    record = provenance()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with node(root, args.host_blocks) as kvbm:
            kvbm.start()
            result = asyncio.run(bench(kvbm.env, root, args))
    r, c = result, result["copy"]
    print(f"gRPC round trip (leader KeepAlive, unix socket): p50 {r['rtt_ms']['p50']:.3f} ms, "
          f"p99 {r['rtt_ms']['p99']:.3f} ms")
    print(f"match (32 hashes): {r['match_ops_s_sequential']:.0f} ops/s sequential, "
          f"{r['match_ops_s_32_in_flight']:.0f} ops/s with 32 in flight")
    print(f"offload cycle (prepare + worker copy + commit, 1 block): {r['offload_cycles_s_1_block']:.0f} /s")
    print(f"CPU copy, {c['bytes'] / 2**20:.0f} MiB batch: memcpy {c['memcpy_GBps']:.2f} GB/s; "
          f"offload {c['offload_GBps']:.2f} GB/s (ratio {c['offload_ratio_to_memcpy']:.2f}); "
          f"onboard {c['onboard_GBps']:.2f} GB/s (ratio {c['onboard_ratio_to_memcpy']:.2f})")
    if args.stall_passes:
        from leader_stall import run_stall_benchmark
        stall = run_stall_benchmark(passes=args.stall_passes)["median"]
        result["leader_stall"] = stall
        for scenario, m in stall.items():
            print(f"leader stall, 65536-key PrepareStore into a G2 full of {scenario} blocks: PrepareStore "
                  f"{m['prepare_store_ms']:.0f} ms; another client's KeepAlive p50 {m['keepalive_p50_ms']:.1f}, "
                  f"p99 {m['keepalive_p99_ms']:.1f}, max {m['keepalive_max_ms']:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": record, **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
