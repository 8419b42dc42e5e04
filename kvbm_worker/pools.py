"""The worker's own tiers: the G2 host pool and the G3 disk file (with its checksum table).

Runs in the worker daemon. Slot ``s`` of a tier holds this worker's shard of one logical
block, ``block_bytes`` long (every layer's page, layer by layer), at ``s * slot_bytes``;
``slot_bytes`` is rounded up to 4096 so every slot is O_DIRECT-aligned.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import logging
import mmap
import os
import sqlite3
import tempfile
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvbm_client.g3_files import PREFIX, SIDE_FILES, remove_index, worker_file_prefix, worker_files
from kvbm_client.procs import remove_stale_files
from kvbm_client.sizing import SLOT_ALIGN, align_up, slot_bytes

from .checksums import SlotSums
from .disk_index import PersistentSlotSums, ShardIndex

log = logging.getLogger("kvbm.worker")

ALIGN = SLOT_ALIGN
DISK_PREFIX = "kvbm-disk-cache-"
_ZERO_CHUNK = 16 << 20


@dataclass(frozen=True, slots=True)
class SlotGeometry:
    block_bytes: int  # useful bytes of one slot: num_layers * page_bytes
    slot_bytes: int  # stride between slots (aligned)
    num_slots: int

    @classmethod
    def of(cls, block_bytes: int, num_slots: int) -> "SlotGeometry":
        return cls(block_bytes, slot_bytes(block_bytes), num_slots)

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.num_slots


class HostPool:
    """G2: anonymous shared memory (pinned with CUDA when a GPU handler registers it).

    NOTE: anonymous (MAP_SHARED|MAP_ANONYMOUS) rather than a named /dev/shm segment, so a
    worker killed with SIGKILL leaves no RAM behind.
    """

    def __init__(self, geometry: SlotGeometry) -> None:
        self.geometry = geometry
        self._mmap = mmap.mmap(-1, max(geometry.total_bytes, ALIGN), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self.buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        self.slots = self.buffer[:geometry.total_bytes].reshape(geometry.num_slots, geometry.slot_bytes)

    @property
    def address(self) -> int:
        return self.buffer.ctypes.data

    def commit(self, progress: Callable[[float], None] | None = None, chunk: int = 256 << 20) -> None:
        """Touch every page so allocation cost is paid now (and shown), not on the data path."""
        total = self.geometry.total_bytes
        for start in range(0, total, chunk):
            self.buffer[start:min(total, start + chunk):4096] = 0
            if progress is not None:
                progress(min(1.0, (start + chunk) / total))

    def close(self) -> None:
        self.slots = self.buffer = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:  # a view still alive somewhere; the GC will unmap it
            log.debug("host pool still referenced at close")


@dataclass(frozen=True, slots=True)
class PersistAs:
    """``DYN_KVBM_DISK_PERSIST``: the G3 file of ``worker_id`` for a shard layout (its name is
    stable, :func:`kvbm_client.g3_files.worker_files`), kept with its shard index on stop;
    ``sync``: flushed to the device around every write (``DYN_KVBM_DISK_PERSIST_SYNC``)."""

    worker_id: str
    fingerprint: str
    sync: bool = True


class DiskPool:
    """G3: one file in the cache directory, and the checksum table of its slots (``sums``).

    Without ``persist``: ``kvbm-disk-cache-<pid>-XXXXXX``, removed on close; files left by
    workers that died (their pid no longer runs) are removed at start-up; the checksums live
    in memory. With ``persist``: ``kvbm-g3-w<worker>.<layout>.data``, reopened if it exists
    (resized to the geometry), locked against a second worker (flock), kept on close, with its
    :class:`~.disk_index.ShardIndex`; files of the same worker for another layout are removed.
    """

    def __init__(self, geometry: SlotGeometry, directory: str, *, o_direct: bool, zerofill_fallback: bool,
                 persist: PersistAs | None = None) -> None:
        self.geometry = geometry
        self.persist = persist
        self.index: ShardIndex | None = None
        self.fd = -1
        os.makedirs(directory, exist_ok=True)
        if persist is None:
            remove_stale_disk_files(directory)
            _mention_persistent_files(directory)
            fd, self.path = tempfile.mkstemp(prefix=f"{DISK_PREFIX}{os.getpid()}-", dir=directory)
            os.close(fd)
            self.index_path = ""
        else:
            self.path, self.index_path = worker_files(directory, persist.worker_id, persist.fingerprint)
            _remove_other_layouts(directory, persist.worker_id, (self.path, self.index_path))
        self.o_direct = o_direct
        try:
            self._open(o_direct, zerofill_fallback)
        except BaseException:
            self.close()
            raise

    def _open(self, o_direct: bool, zerofill_fallback: bool) -> None:
        flags = os.O_RDWR | (os.O_DIRECT if o_direct else 0) | (os.O_CREAT if self.persist else 0)
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open {self.path} with O_DIRECT={o_direct}: {exc.strerror}"
                          + ("; try DYN_KVBM_DISK_DISABLE_O_DIRECT=true" if o_direct else "")) from None
        if self.persist is None:
            self._size_file(0, zerofill_fallback)
            self.sums = SlotSums(self.geometry.num_slots, self.geometry.block_bytes)
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(errno.EBUSY, f"{self.path} is in use by another worker (one node per "
                                       "DYN_KVBM_DISK_CACHE_DIR with DYN_KVBM_DISK_PERSIST)") from None
        size = os.fstat(self.fd).st_size
        fresh = size == 0 or size % ALIGN != 0
        if size > self.geometry.total_bytes or (fresh and size):
            os.ftruncate(self.fd, 0 if fresh else self.geometry.total_bytes)
        self._size_file(0 if fresh else min(size, self.geometry.total_bytes), zerofill_fallback)
        self.index = self._open_index(fresh)
        self.sums = PersistentSlotSums(self.geometry.num_slots, self.geometry.block_bytes, self.index, self.fd,
                                       sync=self.persist.sync)
        log.info("G3 file %s %s: %d slots, %d with durable contents", self.path,
                 "created" if fresh else "reopened", self.geometry.num_slots, int(self.sums.valid.sum()))

    def _open_index(self, fresh: bool) -> ShardIndex:
        assert self.persist is not None
        st, geo, fingerprint = os.fstat(self.fd), self.geometry, self.persist.fingerprint

        def open_index(empty: bool) -> ShardIndex:
            return ShardIndex(self.index_path, identity=f"{st.st_dev}:{st.st_ino}", fresh=empty,
                              num_slots=geo.num_slots, slot_bytes=geo.slot_bytes, fingerprint=fingerprint)

        try:
            return open_index(fresh)
        except sqlite3.DatabaseError as exc:  # not a database any more: its records are lost, not trusted
            if isinstance(exc, sqlite3.OperationalError):  # busy, full, I/O: not the file's fault
                raise OSError(f"G3 shard index {self.index_path}: {exc}") from exc
            log.warning("G3 shard index %s cannot be read (%s); starting an empty one", self.index_path, exc)
            remove_index(self.index_path)
            return open_index(True)

    def _size_file(self, start: int, zerofill_fallback: bool) -> None:
        """Give the file ``geometry.total_bytes`` bytes, allocating from ``start`` on."""
        size = self.geometry.total_bytes
        if size <= start:
            return
        try:
            os.posix_fallocate(self.fd, start, size - start)
            return
        except OSError as exc:
            if not zerofill_fallback:
                raise OSError(exc.errno, f"fallocate({self.path}, {size}) failed: {exc.strerror}; "
                              "set DYN_KVBM_DISK_ZEROFILL_FALLBACK=true on filesystems without "
                              "fallocate") from None
            log.warning("fallocate failed (%s); writing zeros to %s", exc.strerror, self.path)
        zeros = mmap.mmap(-1, _ZERO_CHUNK)  # page-aligned, as O_DIRECT wants
        for off in range(start, size, _ZERO_CHUNK):
            n = min(_ZERO_CHUNK, size - off)
            written = os.pwritev(self.fd, [memoryview(zeros)[:align_up(n)]], off)
            if written < n:
                raise OSError(f"short write while zero-filling {self.path}")
        zeros.close()

    def offset(self, slot: int) -> int:
        return slot * self.geometry.slot_bytes

    def close(self) -> None:
        """Close the file (and the index); a non-persistent file is removed. Idempotent."""
        if self.index is not None:
            self.index.close()
            self.index = None
        if self.fd >= 0:
            os.close(self.fd)  # also releases the flock
            self.fd = -1
        if self.persist is not None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _remove_other_layouts(directory: str, worker_id: str, keep: tuple[str, str]) -> None:
    """A worker's persistent G3 files of another layout can never be read again: remove them."""
    kept = {keep[0], keep[1], *(keep[1] + s for s in SIDE_FILES)}
    pattern = os.path.join(glob.escape(directory), glob.escape(worker_file_prefix(worker_id)) + "*")
    gone = [p for p in glob.glob(pattern) if p not in kept]
    for path in gone:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if gone:
        log.warning("G3 of worker %s: removed %d files of another engine layout (%s)", worker_id, len(gone),
                    ", ".join(sorted(os.path.basename(p) for p in gone)[:4]))


def _mention_persistent_files(directory: str) -> None:
    found = glob.glob(os.path.join(glob.escape(directory), glob.escape(PREFIX) + "*"))
    if found:
        log.info("%d persistent G3 files (DYN_KVBM_DISK_PERSIST=true) in %s are not used now; remove them "
                 "to free their space", len(found), directory)


def remove_stale_disk_files(directory: str) -> list[str]:
    """G3 files of workers that died (their pid no longer runs)."""
    return remove_stale_files(directory, DISK_PREFIX)
