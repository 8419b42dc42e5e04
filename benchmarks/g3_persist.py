"""What a persistent G3 (DYN_KVBM_DISK_PERSIST) costs, in-process, on real files:

* ``store``: a G2 -> G3 batch through the worker's real copy executor (``BlockMover``, O_DIRECT
  writes, the checksums), with a persistent G3 file (``DYN_KVBM_DISK_PERSIST_SYNC`` true, and
  false) against a plain one; every batch rewrites
  slots that hold recorded blocks (the steady state of a full G3), alternating passes, medians;
  plus where the persistent batch spends its extra time (row deletions committed with
  ``synchronous=FULL``, the data file's fdatasync, the row inserts);
* ``journal``: the leader's cost per block on its event loop (one queued change per block), and
  how fast its writer thread applies them;
* ``restore``: the time from the last ``PoolsReady`` to a ready node for an index of N blocks
  (the leader reads its index and every rank's shard index, joins them and fills the
  registry), and a worker's reopen of a G3 file with N recorded slots.

``python benchmarks/g3_persist.py --dir /var/tmp --out benchmarks/results/g3_persist_cpu.json``
(``--dir``: where the files go, i.e. the disk measured).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402

from kvbm_client.config import KvbmConfig  # noqa: E402
from kvbm_client.g3_files import leader_index_path, shard_fingerprint, worker_files, write_tag  # noqa: E402
from kvbm_client.ids import BlockHash, JobId, PlanKind, SlotId, Tier, WorkerId  # noqa: E402
from kvbm_leader.events import KvEventFeed, NullEvents  # noqa: E402
from kvbm_leader.g3_index import G3Index  # noqa: E402
from kvbm_leader.membership import Layout, Membership, WorkerRecord  # noqa: E402
from kvbm_leader.metrics import LeaderMetrics  # noqa: E402
from kvbm_leader.placement import PlacementPolicy  # noqa: E402
from kvbm_leader.policies.frequency import FrequencyFilter  # noqa: E402
from kvbm_leader.restore import G3Restorer  # noqa: E402
from kvbm_worker.disk_index import PersistentSlotSums, ShardIndex  # noqa: E402
from kvbm_worker.handlers.disk import PosixDiskIO  # noqa: E402
from kvbm_worker.handlers.disk_guard import TimedDiskIO  # noqa: E402
from kvbm_worker.id_arrays import Slots  # noqa: E402
from kvbm_worker.jobs import JobKey  # noqa: E402
from kvbm_worker.mover import BlockMover  # noqa: E402
from kvbm_worker.plan_check import Batch  # noqa: E402
from kvbm_worker.pools import DiskPool, HostPool, PersistAs, SlotGeometry  # noqa: E402

LEADER = "leader-bench"


# ---------------------------------------------------------------------------- store batches
class Timed:
    """Wraps a method of one object, adding its wall time to ``seconds``."""

    def __init__(self, obj: Any, name: str) -> None:
        self.seconds, inner = 0.0, getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        setattr(obj, name, timed)


def store_batches(root: Path, block_bytes: int, batch: int, passes: int) -> dict[str, Any]:
    geo = SlotGeometry.of(block_bytes, batch)
    host = HostPool(geo)
    host.slots[:] = np.random.default_rng(0).integers(0, 256, host.slots.shape, dtype=np.uint8)
    rigs = {}
    modes = (("plain", None), ("persistent", PersistAs("0", "bench")), ("no_sync", PersistAs("1", "bench", False)))
    for mode, persist in modes:
        disk = DiskPool(geo, str(root / mode), o_direct=True, zerofill_fallback=False, persist=persist)
        io = TimedDiskIO(PosixDiskIO(disk.fd), timeout=60.0)
        rigs[mode] = (disk, io, BlockMover(host, disk, io, bounce_slots=min(64, batch)))
    durable = rigs["persistent"][0].sums
    assert isinstance(durable, PersistentSlotSums)
    parts = {"delete_rows_fsync": Timed(durable.index, "delete"), "insert_rows": Timed(durable.index, "insert")}
    fdatasync = {"s": 0.0}
    real_fdatasync = os.fdatasync

    def timed_fdatasync(fd: int) -> None:
        t = time.perf_counter()
        real_fdatasync(fd)
        fdatasync["s"] += time.perf_counter() - t

    os.fdatasync = timed_fdatasync  # type: ignore[assignment]
    seconds: dict[str, list[float]] = {mode: [] for mode, _ in modes}
    slots = Slots(np.arange(batch, dtype=np.int64))
    try:
        for i in range(passes + 1):  # pass 0 fills the slots (the later ones rewrite recorded slots)
            for mode, _ in modes if i % 2 else modes[::-1]:
                mover = rigs[mode][2]
                job = Batch(PlanKind.DEMOTE, JobKey(LEADER, 1, JobId(i + 1)), 1e18, demote_host=slots,
                            demote_disk=slots)
                t = time.perf_counter()
                mover.run(job, None, 1e18)
                if i:
                    seconds[mode].append(time.perf_counter() - t)
            if i == 0:
                for p in parts.values():
                    p.seconds = 0.0
                fdatasync["s"] = 0.0
    finally:
        os.fdatasync = real_fdatasync  # type: ignore[assignment]
        for disk, io, mover in rigs.values():
            mover.close()
            io.close()
            disk.close()
        host.close()
    med = {mode: statistics.median(v) for mode, v in seconds.items()}
    plain = med["plain"]
    extra = {k: p.seconds / passes for k, p in parts.items()} | {"fdatasync": fdatasync["s"] / passes}
    out: dict[str, Any] = {"block_bytes": block_bytes, "batch_blocks": batch, "passes": passes,
                           "plain_batch_ms": round(plain * 1e3, 3)}
    for mode in ("persistent", "no_sync"):
        out[mode] = {"batch_ms": round(med[mode] * 1e3, 3), "extra_per_batch_ms": round((med[mode] - plain) * 1e3, 3),
                     "extra_per_block_us": round((med[mode] - plain) / batch * 1e6, 1),
                     "extra_share": round(med[mode] / plain - 1, 3)}
    out["persistent"]["mean_parts_per_batch_ms"] = {k: round(v * 1e3, 3) for k, v in extra.items()}
    return out


def raw_sync(root: Path, passes: int) -> dict[str, float]:
    """The floor of any durable record: a 4 KiB write + fdatasync, and a 4 KiB O_DIRECT write alone."""
    import mmap
    buf = mmap.mmap(-1, 4096)
    path = root / "sync-probe"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    synced, plain = [], []
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        for i in range(passes * 5):
            t = time.perf_counter()
            os.pwritev(fd, [buf], (i % 256) * 4096)
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            os.pwritev(fd, [buf], (i % 256) * 4096)
            os.fdatasync(fd)
            synced.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()
    return {"write_4k_ms": round(statistics.median(plain) * 1e3, 3),
            "write_4k_fdatasync_ms": round(statistics.median(synced) * 1e3, 3)}


# ---------------------------------------------------------------------------- leader journal
async def journal(root: Path, n: int) -> dict[str, Any]:
    index = G3Index(leader_index_path(str(root)), LEADER, LeaderMetrics())
    keys = [BlockHash(i.to_bytes(16, "big")) for i in range(n)]
    t0 = time.perf_counter()
    for i, key in enumerate(keys):
        index.stored(key, None, SlotId(i), JobId(i + 1))
    queued = time.perf_counter() - t0
    await index.call(lambda conn: None)
    applied = time.perf_counter() - t0
    t1 = time.perf_counter()
    for key in keys:
        index.removed(key)
    await index.call(lambda conn: None)
    removed = time.perf_counter() - t1
    await index.close()
    return {"blocks": n, "loop_us_per_block": round(queued / n * 1e6, 2),
            "writer_puts_per_s": round(n / applied), "writer_deletes_per_s": round(n / removed)}


# ---------------------------------------------------------------------------- restore
def make_indexes(root: Path, n: int, workers: list[WorkerId], layers: int) -> None:
    """A leader index of ``n`` committed G3 blocks and each worker's shard index for them."""
    async def leader() -> None:
        index = G3Index(leader_index_path(str(root)), LEADER, LeaderMetrics())
        await restore_once(root, n, workers, layers, index)  # stamps the node fingerprint
        for i in range(n):
            index.stored(BlockHash(i.to_bytes(16, "big")), BlockHash((i - 1).to_bytes(16, "big", signed=True)),
                         SlotId(i), JobId(i + 1))
        await index.close()

    asyncio.run(leader())
    fp = shard_fingerprint(layers, 4096, "bf16")
    for w in workers:
        shard = ShardIndex(worker_files(str(root), w, fp)[1], identity="bench", fresh=False, num_slots=n,
                           slot_bytes=layers * 4096, fingerprint=fp)
        slots = Slots(np.arange(n, dtype=np.int64))
        with shard._transaction():
            shard.conn.executemany("INSERT OR REPLACE INTO shards (slot, tag, sum) VALUES (?, ?, ?)",
                                   ((s, write_tag(LEADER, s + 1), 0) for s in slots.tolist()))
        shard.close()


async def restore_once(root: Path, n: int, workers: list[WorkerId], layers: int,
                       index: G3Index | None = None) -> tuple[float, int]:
    """One leader start's restore: seconds from the last PoolsReady to a ready node, blocks."""
    own = index is None
    metrics = LeaderMetrics()
    index = index or G3Index(leader_index_path(str(root)), "leader-new", metrics)
    config = KvbmConfig(disk_cache_override_num_blocks=n, disk_cache_dir=str(root), disk_persist=True)
    placement = PlacementPolicy({Tier.DISK: n}, FrequencyFilter(100, enabled=False), index)
    membership = Membership(config, workers)
    for rank, w in enumerate(workers):
        membership.attach(WorkerRecord(w, rank, f"unix:/w{w}", 1, False))
        membership.set_layout(w, Layout(layers, 4096, "bf16", 8, rank))
    sizes = membership.replan()
    assert sizes is not None
    placement.resize({Tier.DISK: sizes.disk_slots})
    restorer = G3Restorer(index, placement, membership, KvEventFeed(NullEvents()), metrics)
    fp = shard_fingerprint(layers, 4096, "bf16")
    t = time.perf_counter()
    for w in workers:  # as the fleet does on each PoolsReady: the last one starts the restore
        membership.workers[w].ready_epoch = sizes.epoch
        restorer.pools_ready(w, worker_files(str(root), w, fp)[1])
    assert restorer._task is not None
    await restorer._task
    seconds = time.perf_counter() - t
    assert membership.ready
    restored = len(placement.registry.blocks)
    if own:
        await index.close()
    return seconds, restored


def worker_reopen(root: Path, n: int, layers: int) -> float:
    """A worker's G3 file reopened with ``n`` recorded slots (its checksum table loaded)."""
    fp = shard_fingerprint(layers, 4096, "bf16")
    geo = SlotGeometry.of(layers * 4096, n)
    disk = DiskPool(geo, str(root), o_direct=False, zerofill_fallback=False, persist=PersistAs("9", fp))
    assert disk.index is not None
    with disk.index._transaction():
        disk.index.conn.executemany("INSERT OR REPLACE INTO shards (slot, tag, sum) VALUES (?, ?, ?)",
                                    ((s, s, s) for s in range(n)))
    disk.close()
    t = time.perf_counter()
    disk = DiskPool(geo, str(root), o_direct=False, zerofill_fallback=False, persist=PersistAs("9", fp))
    seconds = time.perf_counter() - t
    assert int(disk.sums.valid.sum()) == n
    disk.close()
    return seconds


def restores(base: Path, sizes: list[int], tp: int, passes: int) -> list[dict[str, Any]]:
    out = []
    workers = [WorkerId(str(r)) for r in range(tp)]
    for n in sizes:
        with tempfile.TemporaryDirectory(dir=base) as d:
            root = Path(d)
            make_indexes(root, n, workers, layers=2)
            runs = [asyncio.run(restore_once(root, n, workers, 2)) for _ in range(passes)]
            assert all(r[1] == n for r in runs), runs
            reopen = [worker_reopen(root / "w", n, 1) for _ in range(passes)]
            out.append({"blocks": n, "ranks": tp, "passes": passes,
                        "leader_restore_s": round(statistics.median(r[0] for r in runs), 3),
                        "worker_reopen_s": round(statistics.median(reopen), 3),
                        "leader_index_bytes": os.path.getsize(leader_index_path(str(root)))})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the G3 files and indexes go")
    parser.add_argument("--out", default=None, help="write the JSON result here (else stdout)")
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    args = parser.parse_args(argv)
    base = Path(args.dir)
    result: dict[str, Any] = {"provenance": provenance(sys.argv), "dir": str(base), "load_before": os.getloadavg()}
    cases = [(64 << 10, 8)] if args.quick else [(64 << 10, 1), (64 << 10, 8), (64 << 10, 64), (2 << 20, 1),
                                                (2 << 20, 8), (2 << 20, 64)]
    with tempfile.TemporaryDirectory(dir=base) as d:
        result["sync_floor"] = raw_sync(Path(d), args.passes)
        result["store"] = [store_batches(Path(d) / f"{b}-{n}", b, n, args.passes) for b, n in cases]
    with tempfile.TemporaryDirectory(dir=base) as d:
        result["journal"] = asyncio.run(journal(Path(d), 10_000 if args.quick else 100_000))
    sizes = [10_000] if args.quick else [10_000, 100_000]
    result["restore"] = restores(base, sizes, 1, 3) + restores(base, sizes, 2, 3)
    result["load_after"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
