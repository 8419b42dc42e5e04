"""`kvbm doctor`'s persistent-G3 check (disk.persist) on files written by the real worker and
leader classes: off (with and without leftovers), no index yet, a healthy index, a worker's
index or file missing or of the wrong size, a damaged leader index."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from kvbm_client.doctor import g3
from kvbm_client.doctor.base import DoctorContext, Status
from kvbm_client.g3_files import leader_index_path
from kvbm_client.ids import BlockHash, JobId, SlotId
from kvbm_leader.g3_index import G3Index
from kvbm_leader.metrics import LeaderMetrics
from kvbm_worker.id_arrays import Slots
from kvbm_worker.jobs import JobKey
from kvbm_worker.pools import DiskPool, PersistAs, SlotGeometry

LEADER = "leader-doc"


def ctx(directory: Path, persist: bool = True) -> DoctorContext:
    return DoctorContext.from_env({"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "8", "DYN_KVBM_DISK_CACHE_DIR":
                                   str(directory), "DYN_KVBM_DISK_PERSIST": "true" if persist else "false"})


def node_files(directory: Path, blocks: int = 5, workers: tuple[str, ...] = ("0", "1")) -> None:
    """What a node leaves after storing ``blocks`` blocks in G3 slots 0.. (jobs 1..)."""
    for w in workers:
        disk = DiskPool(SlotGeometry.of(3000, 8), str(directory), o_direct=False, zerofill_fallback=False,
                        persist=PersistAs(w, "00aa00aa00aa00aa"))
        for i in range(blocks):
            slot = Slots(np.array([i], np.int64))
            disk.sums.forget(slot)
            disk.sums.record(slot, np.array([i], np.uint64), JobKey(LEADER, 1, JobId(i + 1)))
        disk.close()

    async def leader() -> None:
        index = G3Index(leader_index_path(str(directory)), LEADER, LeaderMetrics())
        for i in range(blocks):
            index.stored(BlockHash(bytes([i]) * 16), None, SlotId(i), JobId(i + 1))
        await index.close()

    asyncio.run(leader())


def test_off_without_files_skips(tmp_path: Path) -> None:
    assert g3.check_persist(ctx(tmp_path, persist=False)).status is Status.SKIP


def test_off_with_leftovers_says_so(tmp_path: Path) -> None:
    node_files(tmp_path)
    result = g3.check_persist(ctx(tmp_path, persist=False))
    assert result.status is Status.INFO and "not used with DYN_KVBM_DISK_PERSIST off" in result.message


def test_no_index_yet(tmp_path: Path) -> None:
    result = g3.check_persist(ctx(tmp_path))
    assert result.status is Status.INFO and "first start creates it" in result.message


def test_healthy_index_counts_what_a_start_restores(tmp_path: Path) -> None:
    node_files(tmp_path)
    result = g3.check_persist(ctx(tmp_path))
    assert result.status is Status.OK, result.message
    assert result.data["blocks"] == 5 and result.data["restorable"] == 5 and result.data["workers"] == ["0", "1"]


@pytest.mark.parametrize("damage", ["index", "data", "size"])
def test_a_worker_file_problem_warns(tmp_path: Path, damage: str) -> None:
    node_files(tmp_path)
    shard = next(s for s in g3.find_shards(str(tmp_path)) if s.worker == "1")
    if damage == "index":
        os.unlink(shard.index)
    elif damage == "data":
        os.unlink(shard.data)
    else:
        os.truncate(shard.data, 4096)
    result = g3.check_persist(ctx(tmp_path))
    assert result.status is Status.WARN and "worker 1:" in result.message
    if damage != "size":
        assert result.data["restorable"] == 0


def test_a_damaged_leader_index_fails(tmp_path: Path) -> None:
    node_files(tmp_path)
    path = leader_index_path(str(tmp_path))
    for side in ("-wal", "-shm"):
        if os.path.exists(path + side):
            os.unlink(path + side)
    with open(path, "r+b") as f:
        f.write(b"garbage!" * 64)
    result = g3.check_persist(ctx(tmp_path))
    assert result.status is Status.FAIL and "starts with an empty one" in result.message
