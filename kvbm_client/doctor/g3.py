"""The persistent G3 (``DYN_KVBM_DISK_PERSIST``): do the indexes open, do they match the files,
and how many blocks would a start restore.

Runs in ``kvbm doctor``; reads only (a running node's files are read beside it: SQLite's WAL
lets a reader in while the daemons write). Files and schemas: :mod:`kvbm_client.g3_files`.
"""
from __future__ import annotations

import glob
import os
import sqlite3
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..g3_files import (DATA_SUFFIX, INDEX_SUFFIX, PREFIX, ShardSource, files_bytes, join, leader_index_path,
                        read_meta, read_shard_tags)
from ..ids import WorkerId
from .base import Check, CheckResult, DoctorContext, fail, info, ok, skip, warn

_REMOVE = "stop the node and remove the kvbm-g3-* files in DYN_KVBM_DISK_CACHE_DIR (G3 then starts empty)"


@dataclass(frozen=True)
class ShardFiles:
    """One worker's persistent G3 file and its shard index, as found in the directory."""

    worker: str  # the worker id as it appears in the names
    fingerprint: str
    data: str
    index: str


def _open(path: str) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=2.0)


def find_shards(directory: str) -> list[ShardFiles]:
    """Every ``kvbm-g3-w<worker>.<fingerprint>.{data,idx}`` pair (either file may be missing)."""
    stems = set()
    for path in glob.glob(os.path.join(glob.escape(directory), glob.escape(PREFIX) + "w*")):
        name = os.path.basename(path)
        for suffix in (DATA_SUFFIX, INDEX_SUFFIX):
            if name.endswith(suffix):
                stems.add(name[len(PREFIX) + 1:-len(suffix)])
    out = []
    for stem in sorted(stems):
        worker, _, fingerprint = stem.rpartition(".")
        base = os.path.join(directory, f"{PREFIX}w{stem}")
        out.append(ShardFiles(worker, fingerprint, base + DATA_SUFFIX, base + INDEX_SUFFIX))
    return out


def _shard_problem(shard: ShardFiles) -> tuple[str, bool] | None:
    """What is wrong with a worker's files, and whether it means none of its shards can be
    restored; None when nothing is. Checks the index's integrity and the data file's size."""
    if not os.path.exists(shard.index):
        return f"worker {shard.worker}: a G3 file without its index (its blocks are not restored)", True
    if not os.path.exists(shard.data):
        return f"worker {shard.worker}: an index without its G3 file (emptied at the next start)", True
    try:
        conn = _open(shard.index)
        try:
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            meta = read_meta(conn)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return f"worker {shard.worker}: index unreadable ({exc})", True
    if check != "ok":
        return f"worker {shard.worker}: index damaged ({check})", True
    want = int(meta.get("num_slots", 0)) * int(meta.get("slot_bytes", 0))
    if os.path.getsize(shard.data) != want:
        return (f"worker {shard.worker}: G3 file of {os.path.getsize(shard.data)} bytes, its index expects {want} "
                "(resized at the next start)"), False
    return None


def _leader_rows(path: str) -> tuple[str, Any] | str:
    """(fingerprint, rows of (slot, tag)) of the leader's index, or why it cannot be read."""
    try:
        conn = _open(path)
        try:
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                return f"damaged ({check})"
            rows = conn.execute("SELECT slot, tag FROM blocks ORDER BY rowid").fetchall()
            return read_meta(conn).get("fingerprint", ""), np.array(rows, np.int64).reshape(-1, 2)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return f"unreadable ({exc})"


def check_persist(ctx: DoctorContext) -> CheckResult:
    """The leader's index and every worker's files open, are intact and agree."""
    cfg = ctx.cfg
    if not cfg.disk_enabled:
        return skip("no G3 configured")
    directory = cfg.disk_cache_dir
    found = glob.glob(os.path.join(glob.escape(directory), glob.escape(PREFIX) + "*"))
    if not cfg.disk_persist:
        if found:
            return info(f"{len(found)} persistent G3 files ({files_bytes(found) / 1e9:.2f} GB) in {directory} are "
                        "not used with DYN_KVBM_DISK_PERSIST off", "remove them, or set DYN_KVBM_DISK_PERSIST=true")
        return skip("DYN_KVBM_DISK_PERSIST is off: G3 starts empty after every restart")
    leader = leader_index_path(directory)
    if not os.path.exists(leader):
        return info(f"no G3 index in {directory} yet: the first start creates it")
    rows = _leader_rows(leader)
    if isinstance(rows, str):
        return fail(f"the leader's G3 index {leader} is {rows}: the leader starts with an empty one", _REMOVE)
    fingerprint, pairs = rows
    shards = find_shards(directory)
    problems = {s.worker: p for s in shards if (p := _shard_problem(s)) is not None}
    restorable = _restorable(pairs, shards, {w for w, (_, fatal) in problems.items() if fatal})
    index_bytes = files_bytes([leader, *(s.index for s in shards)])
    data = {"blocks": len(pairs), "restorable": restorable, "workers": sorted(s.worker for s in shards),
            "index_bytes": index_bytes, "layout": fingerprint}
    summary = (f"{len(pairs)} blocks indexed, {restorable} with every worker's shard recorded "
               f"({len(shards)} worker files; {index_bytes / 1e6:.1f} MB of index)")
    if problems:
        return warn(f"{summary}; " + "; ".join(p for p, _ in problems.values()), "a block without every rank's shard is discarded at "
                    "start; if this is not expected, " + _REMOVE, **data)
    return ok(summary, **data)


def _restorable(pairs: Any, shards: list[ShardFiles], unusable: set[str]) -> int:
    """Blocks whose every worker file records the slot with the same tag (the restore's join,
    without the layout check: doctor does not know the engine's layout)."""
    if not len(pairs) or not shards:
        return 0
    num_slots = int(pairs[:, 0].max()) + 1
    tags = {WorkerId(s.worker): "unusable" if s.worker in unusable else
            read_shard_tags(s.worker, ShardSource(s.index, s.fingerprint), num_slots) for s in shards}
    keep, _ = join(pairs[:, 0], pairs[:, 1], num_slots, tags)
    return int(keep.sum())


CHECKS = (Check("disk", "persist", check_persist),)
