"""A worker's G3 shard index: the durable record of which slots of its G3 file hold finished,
durable writes, by which job, with which checksum (``DYN_KVBM_DISK_PERSIST``).

Runs in the worker daemon. Opened with the disk pool (on the allocation thread), written only
on the store lane (every G3 write is a store-lane job: stores, demotions), closed after the
lanes drained. Storage: SQLite in WAL mode (:mod:`kvbm_client.g3_files`), one row per slot.

Invariant (what makes a restore safe): a row ``(slot, tag, sum)`` exists only while the slot's
bytes in the data file are durable and are exactly those job ``tag`` wrote, whose xxh3-64 is
``sum``. Kept by the write order of :class:`PersistentSlotSums`:

1. ``forget`` (before a slot is overwritten): its row is deleted and the deletion committed
   (with ``sync``: ``synchronous=FULL``, the WAL is fsynced), so a torn write is never indexed;
2. the bytes are written (the mover), then (with ``sync``) the data file is fdatasync'ed;
3. ``record``: the rows are written (``synchronous=NORMAL``: a row lost to a power loss only
   loses a block; the next FULL commit makes it durable).

A failure at any step raises before the next: the slot has no row, its block is not indexed.

NOTE: every committed transaction survives the death of the process (the WAL is in the page
cache) and every O_DIRECT write has reached the device when it returns, so without ``sync``
(``DYN_KVBM_DISK_PERSIST_SYNC=false``) the order above still holds across kill -9 and OS
crashes; ``sync`` adds the device flushes that make it hold across a power loss. Either way a
block whose bytes were lost fails its checksum when read and is dropped, never served.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from typing import Iterator

import numpy as np

from kvbm_client.g3_files import (FORMAT, SHARD_SCHEMA, connect, read_meta, to_signed, to_unsigned, transaction,
                                  write_meta, write_tag)

from .checksums import SlotSums, Sums
from .id_arrays import Slots
from .jobs import JobKey

log = logging.getLogger("kvbm.worker")


class ShardIndex:
    """See the module docstring.

    Args:
        path: the index file (created when missing).
        identity: the data file's ``st_dev:st_ino``: an index kept beside another file than
            the one it was written for is emptied.
        fresh: the data file was created (or emptied) now: its slots hold nothing.
        num_slots, slot_bytes, fingerprint: the pool geometry and shard layout; rows of slots
            past ``num_slots`` are dropped, a different slot size or layout empties the index.
    """

    def __init__(self, path: str, *, identity: str, fresh: bool, num_slots: int, slot_bytes: int,
                 fingerprint: str) -> None:
        self.path = path
        self.conn = connect(path, SHARD_SCHEMA, synchronous="FULL")
        try:
            self._reconcile(identity, fresh, num_slots, slot_bytes, fingerprint)
        except BaseException:
            self.conn.close()
            raise

    def _reconcile(self, identity: str, fresh: bool, num_slots: int, slot_bytes: int, fingerprint: str) -> None:
        want = {"format": FORMAT, "data": identity, "fingerprint": fingerprint, "slot_bytes": str(slot_bytes)}
        have = read_meta(self.conn)
        stale = [k for k, v in want.items() if have.get(k) != v]
        with self._transaction():
            count = self.conn.execute("SELECT count(*) FROM shards").fetchone()[0]
            if fresh or stale:
                self.conn.execute("DELETE FROM shards")
                if count:
                    log.warning("G3 shard index %s: %d records dropped (%s)", self.path, count,
                                "new data file" if fresh else "changed: " + ", ".join(stale))
            else:
                self.conn.execute("DELETE FROM shards WHERE slot >= ?", (num_slots,))
            write_meta(self.conn, {**want, "num_slots": str(num_slots)})

    @contextlib.contextmanager
    def _transaction(self, synchronous: str = "FULL") -> Iterator[None]:
        """A transaction whose commit is ``synchronous`` (FULL: the WAL is fsynced); a SQLite
        error (a full disk, an I/O error) surfaces as ``OSError``, so the job fails like any
        other disk failure."""
        try:
            self.conn.execute(f"PRAGMA synchronous={synchronous}")
            with transaction(self.conn):
                yield
        except sqlite3.Error as exc:
            raise OSError(f"G3 shard index: {exc}") from exc

    def load(self) -> tuple[Slots, Sums]:
        """Every recorded slot and its checksum."""
        rows = self.conn.execute("SELECT slot, sum FROM shards").fetchall()
        slots = Slots(np.fromiter((r[0] for r in rows), np.int64, len(rows)))
        sums = np.fromiter((to_unsigned(r[1]) for r in rows), np.uint64, len(rows))
        return slots, sums

    def delete(self, slots: Slots, sync: bool = True) -> None:
        """Step 1 of the module docstring: the rows are gone (with ``sync``: on the device) when
        this returns."""
        with self._transaction("FULL" if sync else "NORMAL"):
            self.conn.executemany("DELETE FROM shards WHERE slot = ?", ((s,) for s in slots.tolist()))

    def insert(self, slots: Slots, tag: int, sums: Sums) -> None:
        """Step 3: rows for slots whose bytes are durable."""
        with self._transaction("NORMAL"):
            self.conn.executemany("INSERT OR REPLACE INTO shards (slot, tag, sum) VALUES (?, ?, ?)",
                                  zip(slots.tolist(), (tag,) * len(slots), to_signed(sums.tolist())))

    def close(self) -> None:
        self.conn.close()


class PersistentSlotSums(SlotSums):
    """The checksum table of a persistent G3 file: the in-memory table of :class:`SlotSums`
    (what every read verifies against) kept equal to the shard index, in the write order of
    the module docstring. Borrows the index and the data file's descriptor."""

    def __init__(self, num_slots: int, block_bytes: int, index: ShardIndex, data_fd: int, *,
                 sync: bool = True) -> None:
        super().__init__(num_slots, block_bytes)
        self.index, self.data_fd, self.sync = index, data_fd, sync
        slots, sums = index.load()
        super().record(slots, sums)

    def forget(self, slots: Slots) -> None:
        held = Slots(slots[self.valid[slots]])
        if held.size:
            self.index.delete(held, self.sync)  # committed before the first byte of the slot changes
        super().forget(slots)

    def record(self, slots: Slots, sums: Sums, writer: JobKey | None = None) -> None:
        assert writer is not None, "a persistent G3 slot is recorded with the job that wrote it"
        if self.sync:
            os.fdatasync(self.data_fd)  # the bytes are on the device before their row exists
        self.index.insert(slots, write_tag(writer.leader_id, writer.job_id), sums)
        super().record(slots, sums)

    def reset(self) -> None:
        """NOTE: a no-op: a new pool epoch does not void a persistent G3 (the lanes were
        drained first, so the table equals the index)."""
