"""The presence filter the leader publishes to its clients (format and reader:
:mod:`kvbm_client.presence`): a Bloom filter of every block the node can serve, in a file
clients map read-only, so that a connector answers a cold request's lookup without a round trip.

Runs in the leader, synchronously, driven by :class:`~.events.KvEventFeed` (the one place that
turns block changes into events). Invariants:

* every block a lookup can match has its slots set: a block's slots are set when its store is
  planned (before any copy of it can be ready: a job's copies become ready a slice at a time)
  or it is restored into G3 (before it is announced);
* slots are never cleared one block at a time (they are shared); a block that is gone leaves
  its slots set (a "maybe": the client asks, as without a filter) and counts as *stale*. When the
  stale blocks are a quarter of the live ones (and at least :data:`MIN_STALE`) and the blocks
  added since the last rebuild fill :data:`FILL_TO_REBUILD` of the slots, the filter is rebuilt
  from the registry's blocks in slices of :data:`REBUILD_SLICE` (a few ms each, one per leader
  tick, never on a request's path), into a private copy that also takes the blocks added
  meanwhile; the copy then replaces the file's slots in one copy. A block present throughout has
  its slots set in both, so no reader ever sees it cleared;
* ``clear`` (every block of the node gone: a worker lost, pools re-planned) zeroes the slots.

Owns the file (created 0600, removed on close) and its mapping.
"""
from __future__ import annotations

import hashlib
import logging
import mmap
import os
from typing import Collection

import numpy as np

from kvbm_client.ids import BlockHash
from kvbm_client.presence import HEADER_BYTES, MIX, PROBES, check_slots, header, words

log = logging.getLogger("kvbm.leader")

#: blocks a rebuild reads per leader tick (vectorized: about a millisecond)
REBUILD_SLICE = 8192
#: fewest stale blocks that start a rebuild
MIN_STALE = 4096
#: a rebuild starts only once the blocks added since the last one would set this share of the
#: slots (a "maybe" for a block never stored then comes about its square: 1.4 %); below it a
#: rebuild would save almost no round trip
FILL_TO_REBUILD = 1 / 8


class PresenceFilter:
    """The leader's writable filter of ``slots`` slots, a new file at ``path``."""

    def __init__(self, path: str, slots: int, leader_id: str) -> None:
        check_slots(slots)
        self.slots = slots
        self._mask = np.uint64(slots - 1)
        self.path = path
        size = HEADER_BYTES + slots
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self._mm[:HEADER_BYTES] = header(slots, leader_id)
        #: the file's slots (one byte each, 0 or 1)
        self._slots: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8, offset=HEADER_BYTES)
        #: blocks gone since the last rebuild began (their slots may still be set)
        self.stale = 0
        #: blocks added since the last rebuild began (an upper bound of those whose slots are set)
        self.added = 0
        self.rebuilds = 0
        self._snapshot: list[BlockHash] | None = None  # a rebuild's blocks, read from _pos on
        self._pos = 0
        self._next: np.ndarray | None = None  # a rebuild's slots

    def _set(self, into: np.ndarray, keys: Collection[BlockHash]) -> None:
        """Set ``keys``' slots in ``into`` (one vectorized assignment; ~0.1 ms for 1024 keys)."""
        if keys:
            into[(key_words(keys) & self._mask).astype(np.intp)] = 1

    def add(self, keys: Collection[BlockHash]) -> None:
        """``keys`` may become matchable from now on."""
        assert self._slots is not None, "closed"
        self._set(self._slots, keys)
        self.added += len(keys)
        if self._next is not None:
            self._set(self._next, keys)

    def gone(self, count: int) -> None:
        """``count`` blocks were forgotten (no copy left)."""
        self.stale += count

    def step(self, live: Collection[BlockHash]) -> None:
        """Advance a rebuild by one slice, or start one when the stale blocks call for it
        (``live``: every block the leader holds now, e.g. the registry's ``parents``). Called
        from the leader's tick, never on a request's path."""
        if self._snapshot is None:
            if not self._worth_rebuilding(len(live)):
                return
            self._snapshot, self._pos, self._next = list(live), 0, np.zeros(self.slots, dtype=np.uint8)
            log.debug("presence filter: rebuilding from %d blocks (%d stale, %d added since the last)",
                      len(live), self.stale, self.added)
            self.stale, self.added = 0, len(live)  # (blocks forgotten from now on may be in the snapshot)
        assert self._next is not None and self._slots is not None
        end = min(len(self._snapshot), self._pos + REBUILD_SLICE)
        self._set(self._next, self._snapshot[self._pos:end])
        self._pos = end
        if end == len(self._snapshot):
            self._slots[:] = self._next  # every byte old or new: a block held throughout reads set
            self._snapshot, self._next = None, None
            self.rebuilds += 1

    def _worth_rebuilding(self, live: int) -> bool:
        """Enough blocks are gone (a quarter of those held, and :data:`MIN_STALE`) and the slots
        are full enough (:data:`FILL_TO_REBUILD`) for a rebuild to spare round trips."""
        return (self.stale >= max(MIN_STALE, live // 4)
                and self.added * PROBES >= self.slots * FILL_TO_REBUILD)

    def clear(self) -> None:
        """Every block is gone: zero the slots (a rebuild in progress is dropped)."""
        assert self._slots is not None, "closed"
        self._slots[:] = 0
        self._snapshot, self._next, self.stale, self.added = None, None, 0, 0

    def close(self) -> None:
        """Remove the file (clients keep their mapping of the last slots) and unmap it; idempotent."""
        if self._mm.closed:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._slots = self._next = None  # (the mapping cannot close while an array views it)
        self._mm.close()


def key_words(keys: Collection[BlockHash]) -> np.ndarray:
    """:func:`kvbm_client.presence.words` of every key, in order, as one uint64 array: vectorized
    when the keys are all 16 bytes (kvbm's) or all 8 (Dynamo's), else key by key."""
    lens = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    if (lens == 16).all():
        return np.frombuffer(b"".join(keys), dtype="<u8")
    if (lens == 8).all():
        h = np.frombuffer(b"".join(keys), dtype="<u8")
        return np.stack([h, np.multiply(h, np.uint64(MIX))], axis=1).ravel()
    return np.fromiter((w for key in keys for w in words(key)), dtype=np.uint64, count=2 * len(keys))


#: where filters go: memory-backed (on a disk-backed file every store's scattered writes fault
#: pages back in after each writeback, ~0.5 ms per 1024-block store on an ext4 /tmp)
SHM = "/dev/shm"


def filter_path(socket_dir: str, leader_id: str) -> tuple[str, str]:
    """(directory, file) of this leader's filter: ``/dev/shm/kvbm-UID`` (0700, checked like a
    socket dir) where there is a /dev/shm, else the socket dir itself. The file's name carries a
    digest of the socket dir (one leader per socket dir, many per host), this process's id and
    the leader's id: ``presence-<digest>-<pid>-<leader id>.bits``."""
    directory = os.path.join(SHM, f"kvbm-{os.geteuid()}") if os.path.isdir(SHM) else socket_dir
    return directory, os.path.join(directory, f"{file_prefix(socket_dir)}{os.getpid()}-{leader_id}.bits")


def file_prefix(socket_dir: str) -> str:
    return f"presence-{hashlib.blake2b(os.path.abspath(socket_dir).encode(), digest_size=6).hexdigest()}-"


def remove_stale_files(directory: str, prefix: str) -> None:
    """Remove the filters an earlier leader of the same socket dir (``prefix``) left in
    ``directory``, and those of any leader process that is gone (a leader killed before it could
    remove its own)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (name.startswith("presence-") and name.endswith(".bits")):
            continue
        if name.startswith(prefix) or not _alive(name):
            try:
                os.unlink(os.path.join(directory, name))
                log.info("removed %s, an earlier leader's presence filter", name)
            except OSError:
                pass


def _alive(name: str) -> bool:
    """Whether the process named in a filter's file name may still run (True when unsure)."""
    parts = name.split("-")
    if len(parts) < 3 or not parts[2].isdigit():
        return True
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
