"""The on-disk form of a persistent G3 (``DYN_KVBM_DISK_PERSIST``): file names, layout
fingerprints, write tags and the two SQLite schemas.

Shared by the roles that touch it: each worker writes its own *shard index* (one row per G3
slot whose bytes are durable: the job that wrote them and their xxh3-64), the leader writes
the *block index* (one row per ready G3 block: hash, parent, slot and the job that wrote it)
and joins both at restore (:func:`join`), ``kvbm doctor`` reads them. Naming rules, thin
``sqlite3`` helpers and the pure join; no role's state lives here.

Files in ``DYN_KVBM_DISK_CACHE_DIR`` (the prefix differs from the non-persistent
``kvbm-disk-cache-<pid>-*`` files, which are removed on stop):

    kvbm-g3-w<worker>.<shard fingerprint>.data   the worker's G3 slots (fixed size)
    kvbm-g3-w<worker>.<shard fingerprint>.idx    its shard index (SQLite, WAL)
    kvbm-g3-leader.idx                           the leader's block index (SQLite, WAL)

NOTE: a restored block is one whose leader row and every rank's shard row carry the same
write tag (:func:`write_tag`): the tag names the job that wrote the slot, and a worker
deletes a slot's row durably *before* it overwrites the slot, so a matching tag proves the
slot still holds the bytes that job wrote.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sqlite3
import stat
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence
from urllib.parse import quote

import numpy as np
import numpy.typing as npt

from .ids import WorkerId

PREFIX = "kvbm-g3-"
LEADER_INDEX = f"{PREFIX}leader.idx"
DATA_SUFFIX, INDEX_SUFFIX = ".data", ".idx"
#: The files SQLite keeps beside a database in WAL mode.
SIDE_FILES = ("-wal", "-shm")
FORMAT = "1"

SHARD_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS shards (slot INTEGER PRIMARY KEY, tag INTEGER NOT NULL, sum INTEGER NOT NULL);
"""
BLOCK_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (key BLOB PRIMARY KEY, parent BLOB, slot INTEGER NOT NULL,
                                   tag INTEGER NOT NULL);
"""
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _digest(text: str, size: int = 8) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=size).digest()


def shard_fingerprint(num_layers: int, page_bytes: int, dtype: str) -> str:
    """What one worker's shard of a block looks like: a G3 file is only read back by a worker
    whose engine has the same layers, page bytes and dtype (16 hex digits)."""
    return _digest(f"v{FORMAT}|layers={num_layers}|page={page_bytes}|dtype={dtype}").hex()


def node_fingerprint(shards: Iterable[tuple[str, int, str]]) -> str:
    """The node's layout: every (worker id, rank, shard fingerprint), in rank order. A block
    index written under another fingerprint is discarded."""
    parts = sorted(shards, key=lambda s: (s[1], s[0]))
    return _digest("|".join(f"{w}@{r}:{fp}" for w, r, fp in parts), 12).hex()


def worker_stem(worker_id: str) -> str:
    """A worker id as it appears in file names (hashed when it has other characters)."""
    return worker_id if _SAFE_ID.fullmatch(worker_id) else "h" + _digest(worker_id).hex()


def worker_files(directory: str, worker_id: str, fingerprint: str) -> tuple[str, str]:
    """(data file, shard index) of ``worker_id`` for a shard layout."""
    base = os.path.join(directory, f"{PREFIX}w{worker_stem(worker_id)}.{fingerprint}")
    return base + DATA_SUFFIX, base + INDEX_SUFFIX


def worker_file_prefix(worker_id: str) -> str:
    """Every persistent G3 file of ``worker_id`` (any layout) starts with this."""
    return f"{PREFIX}w{worker_stem(worker_id)}."


def leader_index_path(directory: str) -> str:
    return os.path.join(directory, LEADER_INDEX)


def write_tag(leader_id: str, job_id: int) -> int:
    """The signed 64-bit tag of the job that wrote a G3 slot (job ids are unique within one
    leader incarnation, leader ids across them)."""
    return int.from_bytes(_digest(f"{leader_id}#{job_id}"), "little", signed=True)


def to_signed(values: Sequence[int]) -> list[int]:
    """uint64 checksums as SQLite's signed INTEGER."""
    return [v - (1 << 64) if v >= 1 << 63 else v for v in values]


def to_unsigned(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


def connect(path: str, schema: str, *, synchronous: str = "NORMAL") -> sqlite3.Connection:
    """Open (creating) an index in WAL mode, autocommit (transactions are explicit)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.executescript(schema)
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` on an autocommit connection, rolled back when the body
    or the commit fails (the connection is then usable again)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def read_meta(conn: sqlite3.Connection) -> dict[str, str]:
    return dict(conn.execute("SELECT name, value FROM meta").fetchall())


def write_meta(conn: sqlite3.Connection, values: dict[str, str]) -> None:
    """Inside the caller's transaction."""
    conn.executemany("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)", list(values.items()))


def files_bytes(paths: Iterable[str]) -> int:
    """Bytes of the given databases with their WAL side files (missing ones count 0)."""
    total = 0
    for path in paths:
        for p in (path, *(path + s for s in SIDE_FILES)):
            try:
                total += os.stat(p).st_size
            except OSError:
                pass
    return total


# ---------------------------------------------------------------------------- the restore join
Mask = npt.NDArray[np.bool_]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class ShardTags:
    """One rank's shard index, as the join needs it: which slots have a row, and its tag."""

    has: Mask
    tags: I64


@dataclass(frozen=True, slots=True)
class ShardSource:
    """Where one worker's shard index is (its ``PoolsReady``) and the layout it must be of."""

    path: str
    fingerprint: str


def read_shard_tags(worker_id: str, source: ShardSource, num_slots: int) -> ShardTags | str:
    """One worker's shard index, or why it cannot be used. Reads only; the path must be the
    worker's own index file for its layout, a regular file of ours."""
    directory = os.path.dirname(source.path)
    if not source.path or source.path != worker_files(directory, worker_id, source.fingerprint)[1]:
        return "no shard index reported" if not source.path else "a shard index of another name or layout"
    try:
        st = os.lstat(source.path)
    except FileNotFoundError:
        return "its shard index is missing"
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return "its shard index is not a regular file of ours"
    try:
        conn = sqlite3.connect(f"file:{quote(source.path)}?mode=rw", uri=True, timeout=10.0)
        try:
            if read_meta(conn).get("fingerprint") != source.fingerprint:
                return "its shard index is of another layout"
            rows = conn.execute("SELECT slot, tag FROM shards WHERE slot < ?", (num_slots,)).fetchall()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return f"its shard index cannot be read ({exc})"
    pairs = np.array(rows, np.int64).reshape(-1, 2)
    has, tags = np.zeros(num_slots, bool), np.zeros(num_slots, np.int64)
    has[pairs[:, 0]] = True
    tags[pairs[:, 0]] = pairs[:, 1]
    return ShardTags(has, tags)


def join(slots: I64, tags: I64, num_slots: int,
         shards: Mapping[WorkerId, ShardTags | str]) -> tuple[Mask, dict[str, int]]:
    """Which block rows are restorable (pure): in range, the same tag in every rank's shard
    index, one row per slot (the latest). Returns the mask and, per reason, the rows dropped."""
    why: dict[str, int] = {}

    def drop(mask: Mask, reason: str, keep: Mask) -> Mask:
        lost = int((keep & ~mask).sum())
        if lost:
            why[reason] = why.get(reason, 0) + lost
        return keep & mask

    keep = drop((slots >= 0) & (slots < num_slots), "outside the G3 size", np.ones(len(slots), bool))
    at = np.where(keep, slots, 0)
    for worker_id, shard in sorted(shards.items()):
        if isinstance(shard, str):
            keep = drop(np.zeros(len(slots), bool), f"worker {worker_id}: {shard}", keep)
        else:
            keep = drop(shard.has[at], f"worker {worker_id}: no record of the slot (write unfinished, or "
                        "its G3 file or index lost)", keep)
            keep = drop(shard.tags[at] == tags, f"worker {worker_id}: slot rewritten since", keep)
    rows = np.nonzero(keep)[0][::-1]  # latest first: np.unique keeps the first of each slot
    _, first = np.unique(slots[rows], return_index=True)
    latest = np.zeros(len(slots), bool)
    latest[rows[first]] = True
    return drop(latest, "slot named twice", keep), why


def remove_index(path: str) -> None:
    """Remove a database and its side files."""
    for p in (path, *(path + s for s in SIDE_FILES)):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
