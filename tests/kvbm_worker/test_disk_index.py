"""A persistent G3 file and its shard index (DYN_KVBM_DISK_PERSIST), on a real file and a real
SQLite database, without daemons: reopen, the write order (row deleted before a rewrite, written
after), resizing, a replaced or lost data file, a corrupt index, the lock, other layouts."""
from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvbm_client.g3_files import to_unsigned, worker_files, write_tag
from kvbm_client.ids import JobId, PlanKind
from kvbm_worker.disk_index import PersistentSlotSums
from kvbm_worker.handlers.disk import PosixDiskIO
from kvbm_worker.handlers.disk_guard import TimedDiskIO
from kvbm_worker.id_arrays import Slots
from kvbm_worker.jobs import JobKey
from kvbm_worker.mover import BlockMover
from kvbm_worker.plan_check import Batch
from kvbm_worker.pools import DiskPool, HostPool, PersistAs, SlotGeometry

BLOCK = 3000  # useful bytes of a shard (4096-byte slots)
AS = PersistAs("0", "00112233aabbccdd")
JOB = JobKey("leader-test", 1, JobId(7))


def pool(root: Path, slots: int = 16, persist: PersistAs | None = AS) -> DiskPool:
    return DiskPool(SlotGeometry.of(BLOCK, slots), str(root), o_direct=False, zerofill_fallback=False,
                    persist=persist)


def write(p: DiskPool, slots: list[int], seed: int, job: JobKey = JOB) -> list[int]:
    """What the mover does for a G3 write: forget, write the bytes, record; returns the sums."""
    rows = np.random.default_rng(seed).integers(0, 256, (len(slots), BLOCK), dtype=np.uint8)
    ids = Slots(np.array(slots, np.int64))
    p.sums.forget(ids)
    for slot, row in zip(slots, rows):
        os.pwrite(p.fd, row.tobytes(), p.offset(slot))
    sums = [xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows]
    p.sums.record(ids, np.array(sums, np.uint64), job)
    return sums


def rows_of(index_path: str) -> dict[int, tuple[int, int]]:
    """The shard index as another process would read it: slot -> (tag, sum)."""
    conn = sqlite3.connect(index_path)
    try:
        return {s: (t, to_unsigned(x)) for s, t, x in conn.execute("SELECT slot, tag, sum FROM shards")}
    finally:
        conn.close()


def test_reopen_keeps_the_file_and_its_checksums(tmp_path: Path) -> None:
    p = pool(tmp_path)
    assert isinstance(p.sums, PersistentSlotSums)
    sums = write(p, [2, 3, 9], seed=1)
    p.close()
    assert os.path.exists(p.path) and os.path.exists(p.index_path), "a persistent G3 outlives close()"
    again = pool(tmp_path)
    assert again.path == p.path
    assert np.flatnonzero(again.sums.valid).tolist() == [2, 3, 9]
    assert again.sums.sums[[2, 3, 9]].tolist() == sums
    assert rows_of(again.index_path)[3] == (write_tag("leader-test", 7), sums[1])
    again.close()


def test_a_slot_row_is_gone_durably_before_its_bytes_change(tmp_path: Path) -> None:
    p = pool(tmp_path)
    write(p, [4, 5], seed=1)
    p.sums.forget(Slots(np.array([4], np.int64)))  # an overwrite of slot 4 begins ...
    assert set(rows_of(p.index_path)) == {5}, "the deletion is committed before the first byte moves"
    os.pwrite(p.fd, b"\xff" * 100, p.offset(4))  # ... and is killed half way: no record follows
    os.close(p.fd)  # kill -9: nothing else is closed
    p.fd = -1
    p.index.conn.close()
    p.index = None
    again = pool(tmp_path)
    assert np.flatnonzero(again.sums.valid).tolist() == [5]
    again.close()


def test_a_failed_record_leaves_the_slot_without_a_checksum(tmp_path: Path) -> None:
    p = pool(tmp_path)
    p.index.conn.close()  # the index cannot be written (stands for a full disk or an I/O error)
    with pytest.raises(OSError, match="G3 shard index"):
        write(p, [1], seed=1)
    assert not p.sums.valid[1]
    p.index = None
    p.close()


def test_resize_drops_rows_past_the_end_and_keeps_the_rest(tmp_path: Path) -> None:
    p = pool(tmp_path, 16)
    write(p, [1, 14], seed=1)
    p.close()
    small = pool(tmp_path, 8)
    assert os.path.getsize(small.path) == 8 * 4096
    assert np.flatnonzero(small.sums.valid).tolist() == [1]
    small.close()
    big = pool(tmp_path, 32)
    assert os.path.getsize(big.path) == 32 * 4096
    assert np.flatnonzero(big.sums.valid).tolist() == [1]
    big.close()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_lost_or_replaced_data_file_empties_the_index(tmp_path: Path, how: str) -> None:
    p = pool(tmp_path)
    write(p, [0, 1], seed=1)
    p.close()
    if how == "deleted":
        os.unlink(p.path)
    else:  # the same name, the same size, another file (another inode)
        os.rename(p.path, p.path + ".old")
        with open(p.path + ".old", "rb") as src, open(p.path, "wb") as dst:
            dst.write(src.read())
    again = pool(tmp_path)
    assert not again.sums.valid.any()
    assert rows_of(again.index_path) == {}
    again.close()


def test_a_corrupt_index_starts_empty(tmp_path: Path) -> None:
    p = pool(tmp_path)
    write(p, [0], seed=1)
    p.close()
    for side in ("-wal", "-shm"):
        if os.path.exists(p.index_path + side):
            os.unlink(p.index_path + side)
    with open(p.index_path, "r+b") as f:
        f.write(b"this is not a database" * 200)
    again = pool(tmp_path)
    assert not again.sums.valid.any()
    again.close()


def test_a_second_worker_on_the_same_file_is_refused(tmp_path: Path) -> None:
    p = pool(tmp_path)
    with pytest.raises(OSError, match="in use by another worker"):
        pool(tmp_path)
    p.close()


def test_files_of_another_layout_are_removed(tmp_path: Path) -> None:
    old = pool(tmp_path, persist=PersistAs("0", "ffffffffffffffff"))
    write(old, [0], seed=1)
    old.close()
    other_worker = pool(tmp_path, persist=PersistAs("1", "ffffffffffffffff"))
    other_worker.close()
    p = pool(tmp_path)
    names = sorted(n.name for n in tmp_path.iterdir())
    assert not any(n.startswith("kvbm-g3-w0.ffffffffffffffff") for n in names)
    assert any(n.startswith("kvbm-g3-w1.ffffffffffffffff") for n in names), "another worker's files stay"
    assert worker_files(str(tmp_path), "0", AS.fingerprint)[0] == p.path
    p.close()


def test_without_persistence_the_file_is_removed_and_nothing_is_indexed(tmp_path: Path) -> None:
    p = pool(tmp_path, persist=None)
    assert not isinstance(p.sums, PersistentSlotSums) and p.index_path == ""
    p.close()
    assert list(tmp_path.iterdir()) == []


def test_mover_demotion_is_recorded_and_verified_after_reopen(tmp_path: Path) -> None:
    """G2 -> G3 through the real copy executor, the G3 file reopened, G3 -> G2 verified."""
    geo = SlotGeometry.of(BLOCK, 8)
    host = HostPool(geo)
    host.slots[:, :BLOCK] = np.random.default_rng(3).integers(0, 256, (8, BLOCK), dtype=np.uint8)
    expected = host.slots[[0, 1], :BLOCK].copy()

    def run(batch: Batch) -> None:
        disk = pool(tmp_path, 8)
        io = TimedDiskIO(PosixDiskIO(disk.fd), timeout=5.0)
        mover = BlockMover(host, disk, io, bounce_slots=4)
        try:
            mover.run(batch, None, 1e18)
        finally:
            mover.close()
            io.close()
            disk.close()

    slots = lambda *s: Slots(np.array(s, np.int64))  # noqa: E731
    run(Batch(PlanKind.DEMOTE, JOB, 1e18, demote_host=slots(0, 1), demote_disk=slots(5, 6)))
    host.slots[:] = 0
    run(Batch(PlanKind.PROMOTE, JobKey("leader-test", 2, JobId(8)), 1e18, promote_host=slots(2, 3),
              promote_disk=slots(5, 6)))
    assert np.array_equal(host.slots[[2, 3], :BLOCK], expected)
    assert {s: t for s, (t, _) in rows_of(worker_files(str(tmp_path), "0", AS.fingerprint)[1]).items()} == \
        {5: write_tag("leader-test", 7), 6: write_tag("leader-test", 7)}
    host.close()
