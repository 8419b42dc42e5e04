"""The leader's G3 block index: which block each ready G3 slot holds, written by which job
(``DYN_KVBM_DISK_PERSIST``).

Runs in the leader. The registry reports changes of ready G3 copies through the
:class:`~.registry_types.DiskJournal` calls (:meth:`G3Index.stored`, :meth:`G3Index.removed`): they
only queue the change, on the event loop. One writer thread owns the SQLite connection
(:mod:`kvbm_client.g3_files`, WAL mode, ``synchronous=NORMAL``) and applies whatever has
queued in one transaction (group commit); :meth:`G3Index.call` runs a function on that thread
after every change queued before it (the restore reads the index that way).

NOTE: nothing here has to be durable *before* anything else happens. A row is written only
after the leader committed the block (every worker reported its shard durable and recorded),
and a restore uses a row only if every rank's shard index still has the same write tag for
that slot; so a row lost in a crash only loses a block, and a stale row (a removal lost in a
crash) never matches a slot that was rewritten since. A write that fails (full disk, I/O
error) is logged and counted (``kvbm_g3_index_errors``): those blocks are not restored after a
restart; the node keeps serving them now.

Lifecycle: built by the leader service (the file is locked with ``flock``: one leader per
index), ``close()`` applies what is queued, stops the thread and closes the file (idempotent).
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import queue
import sqlite3
import threading
import time
from typing import Callable, TypeVar

from kvbm_client.errors import KvbmConfigError
from kvbm_client.g3_files import BLOCK_SCHEMA, SIDE_FILES, connect, files_bytes, transaction, write_tag
from kvbm_client.ids import BlockHash, JobId, SlotId

from .metrics import LeaderMetrics

log = logging.getLogger("kvbm.leader")
T = TypeVar("T")
BATCH = 65536  # changes applied in one transaction at most
SIZE_EVERY = 1.0  # seconds between two updates of kvbm_g3_index_bytes
CLOSE_TIMEOUT = 10.0  # seconds close() waits for the writer to apply what is queued
_STOP = object()
_PUT, _DELETE = "put", "delete"  # the first item of a queued change


class _Call:
    """A function to run on the writer thread, and the loop future that gets its result."""

    def __init__(self, fn: Callable[[sqlite3.Connection], object], loop: asyncio.AbstractEventLoop,
                 future: "asyncio.Future[object]") -> None:
        self.fn, self.loop, self.future = fn, loop, future

    def run(self, conn: sqlite3.Connection) -> None:
        try:
            result = self.fn(conn)
        except BaseException as exc:  # handed to the awaiting coroutine
            self.loop.call_soon_threadsafe(_settle, self.future, None, exc)
            return
        self.loop.call_soon_threadsafe(_settle, self.future, result, None)


def _settle(future: "asyncio.Future[object]", result: object, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class G3Index:
    """See the module docstring.

    Args:
        path: the index file (``kvbm-g3-leader.idx`` in the G3 directory).
        leader_id: this leader incarnation (write tags are derived from it and the job id).
        metrics: ``kvbm_g3_index_bytes`` and ``kvbm_g3_index_errors`` are kept there.
    """

    def __init__(self, path: str, leader_id: str, metrics: LeaderMetrics) -> None:
        self.path, self.leader_id, self.metrics = path, leader_id, metrics
        #: other files counted in the index size (the workers' shard indexes)
        self.sized_with: tuple[str, ...] = ()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise KvbmConfigError(f"{path} is locked by another kvbm leader (one node per "
                                  "DYN_KVBM_DISK_CACHE_DIR with DYN_KVBM_DISK_PERSIST)") from None
        try:
            self._conn = self._open()
        except sqlite3.Error as exc:
            os.close(self._lock_fd)
            raise KvbmConfigError(f"cannot open the G3 index {path}: {exc}") from None
        self._ops: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._sized_at = 0.0
        self._thread = threading.Thread(target=self._serve, name="kvbm-g3-index", daemon=True)
        self._thread.start()
        self._closed = False

    def _open(self) -> sqlite3.Connection:
        try:
            return connect(self.path, BLOCK_SCHEMA)
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError):  # busy, full, I/O: not the file's fault
                raise
            # NOTE: not a database any more: its rows are lost (G3 starts empty), never trusted
            log.warning("G3 index %s cannot be read (%s); starting an empty one", self.path, exc)
            for side in SIDE_FILES:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path + side)
            os.ftruncate(self._lock_fd, 0)
            return connect(self.path, BLOCK_SCHEMA)

    # ------------------------------------------------------------------ journal (event loop)
    def stored(self, key: BlockHash, parent: BlockHash | None, slot: SlotId, job: JobId) -> None:
        self._ops.put((_PUT, key, parent, slot, job))

    def removed(self, key: BlockHash) -> None:
        self._ops.put((_DELETE, key))

    async def call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(connection)`` on the writer thread, after every change queued before this call."""
        if self._closed:
            raise RuntimeError("G3Index is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        self._ops.put(_Call(fn, loop, future))
        return await future  # type: ignore[return-value]

    # ------------------------------------------------------------------ writer thread
    def _serve(self) -> None:
        while True:
            batch = [self._ops.get()]
            while len(batch) < BATCH:
                try:
                    batch.append(self._ops.get_nowait())
                except queue.Empty:
                    break
            changes: list[object] = []
            for item in batch:
                if isinstance(item, _Call) or item is _STOP:
                    self._apply(changes)
                    changes = []
                    if item is _STOP:
                        return
                    assert isinstance(item, _Call)
                    item.run(self._conn)
                else:
                    changes.append(item)
            self._apply(changes)

    def _apply(self, changes: list[object]) -> None:
        if not changes:
            return
        conn = self._conn
        try:
            with transaction(conn):
                for change in changes:
                    assert isinstance(change, tuple)
                    if change[0] == _PUT:
                        _, key, parent, slot, job = change
                        conn.execute("INSERT OR REPLACE INTO blocks (key, parent, slot, tag) VALUES (?, ?, ?, ?)",
                                     (key, parent, slot, write_tag(self.leader_id, job)))
                    else:
                        conn.execute("DELETE FROM blocks WHERE key = ?", (change[1],))
        except sqlite3.Error as exc:
            self.metrics.inc("kvbm_g3_index_errors")
            log.warning("G3 index: %d changes not written (%s); those blocks will not be restored after a restart",
                        len(changes), exc)
        self._update_size()

    def _update_size(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._sized_at >= SIZE_EVERY:
            self._sized_at = now
            self.metrics.values["kvbm_g3_index_bytes"] = float(files_bytes((self.path, *self.sized_with)))

    def size_now(self, conn: sqlite3.Connection) -> None:
        """(On the writer thread, through :meth:`call`) refresh ``kvbm_g3_index_bytes`` now."""
        self._update_size(force=True)

    # ------------------------------------------------------------------ lifecycle
    async def close(self) -> None:
        """Write what is queued, stop the thread, close and unlock the file; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ops.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, CLOSE_TIMEOUT)
        if self._thread.is_alive():  # a hung disk: the thread still uses the connection; it dies with us
            log.warning("G3 index: the writer did not finish within %gs; its last changes may be lost",
                        CLOSE_TIMEOUT)
            return
        self._conn.close()
        os.close(self._lock_fd)
