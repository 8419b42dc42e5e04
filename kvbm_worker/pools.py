"""The worker's own tiers: the G2 host pool and the G3 disk file.

Runs in the worker daemon. Slot ``s`` of a tier holds this worker's shard of one logical
block, ``block_bytes`` long (every layer's page, layer by layer), at ``s * slot_bytes``;
``slot_bytes`` is rounded up to 4096 so every slot is O_DIRECT-aligned.
"""
from __future__ import annotations

import logging
import mmap
import os
import tempfile
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvbm_client.procs import remove_stale_files
from kvbm_client.sizing import SLOT_ALIGN, align_up, slot_bytes

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


class DiskPool:
    """G3: one file ``kvbm-disk-cache-<pid>-XXXXXX`` in the cache directory, removed on close.

    Files left by workers that died (their pid no longer runs) are removed at start-up.
    """

    def __init__(self, geometry: SlotGeometry, directory: str, *, o_direct: bool, zerofill_fallback: bool) -> None:
        self.geometry = geometry
        os.makedirs(directory, exist_ok=True)
        remove_stale_disk_files(directory)
        fd, self.path = tempfile.mkstemp(prefix=f"{DISK_PREFIX}{os.getpid()}-", dir=directory)
        os.close(fd)
        flags = os.O_RDWR | (os.O_DIRECT if o_direct else 0)
        try:
            self.fd = os.open(self.path, flags)
        except OSError as exc:
            os.unlink(self.path)
            raise OSError(exc.errno, f"cannot open {self.path} with O_DIRECT={o_direct}: {exc.strerror}"
                          + ("; try DYN_KVBM_DISK_DISABLE_O_DIRECT=true" if o_direct else "")) from None
        self.o_direct = o_direct
        try:
            self._size_file(geometry.total_bytes, zerofill_fallback)
        except BaseException:
            self.close()
            raise

    def _size_file(self, size: int, zerofill_fallback: bool) -> None:
        if size == 0:
            return
        try:
            os.posix_fallocate(self.fd, 0, size)
            return
        except OSError as exc:
            if not zerofill_fallback:
                raise OSError(exc.errno, f"fallocate({self.path}, {size}) failed: {exc.strerror}; "
                              "set DYN_KVBM_DISK_ZEROFILL_FALLBACK=true on filesystems without "
                              "fallocate") from None
            log.warning("fallocate failed (%s); writing zeros to %s", exc.strerror, self.path)
        zeros = mmap.mmap(-1, _ZERO_CHUNK)  # page-aligned, as O_DIRECT wants
        for off in range(0, size, _ZERO_CHUNK):
            n = min(_ZERO_CHUNK, size - off)
            written = os.pwritev(self.fd, [memoryview(zeros)[:align_up(n)]], off)
            if written < n:
                raise OSError(f"short write while zero-filling {self.path}")
        zeros.close()

    def offset(self, slot: int) -> int:
        return slot * self.geometry.slot_bytes

    def close(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def remove_stale_disk_files(directory: str) -> list[str]:
    """G3 files of workers that died (their pid no longer runs)."""
    return remove_stale_files(directory, DISK_PREFIX)
