"""The presence filter the leader publishes to its clients (format and reader:
:mod:`kvbm_client.presence`): a Bloom filter of every block the node can serve, in a file
clients map read-only, so that a connector answers a cold request's lookup without a round trip.

Runs in the leader, synchronously, driven by :class:`~.events.KvEventFeed` (the one place that
turns block changes into events). Invariants:

* every block a lookup can match has its bits set: a block's bits are set when it becomes
  matchable (a store settled, a G3 restore), before the leader answers another request;
* bits are never cleared one block at a time (they are shared); a block that is gone leaves
  its bits set (a "maybe": the client asks, as without a filter) and counts as *stale*. When the
  stale blocks outnumber the live ones (and at least :data:`MIN_STALE`), the filter is rebuilt
  from the registry's blocks in slices of :data:`REBUILD_SLICE` (a few ms each, one per leader
  tick, never on a request's path), into a private copy that also takes the blocks added
  meanwhile; the copy then replaces the file's bits in one copy. A block present throughout has
  its bits set in both, so no reader ever sees it cleared;
* ``clear`` (every block of the node gone: a worker lost, pools re-planned) zeroes the bits.

Owns the file (created 0600, removed on close) and its mapping.
"""
from __future__ import annotations

import logging
import mmap
import os
from typing import Collection

import numpy as np

from kvbm_client.ids import BlockHash
from kvbm_client.presence import HEADER_BYTES, check_bits, file_name, header, key_bytes

log = logging.getLogger("kvbm.leader")

#: blocks a rebuild reads per leader tick (vectorized: a few ms)
REBUILD_SLICE = 65536
#: fewest stale blocks that start a rebuild
MIN_STALE = 4096


class PresenceFilter:
    """The leader's writable filter of ``bits`` bits in ``directory``."""

    def __init__(self, directory: str, bits: int, leader_id: str) -> None:
        check_bits(bits)
        self.bits = bits
        self._mask = np.uint64(bits - 1)
        self.path = os.path.join(directory, file_name(leader_id))
        size = HEADER_BYTES + bits // 8
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self._mm[:HEADER_BYTES] = header(bits, leader_id)
        #: the file's bits, as bytes (bit i: bit i % 8 of byte i // 8)
        self._bits: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8, offset=HEADER_BYTES)
        #: blocks gone since the last rebuild began (their bits may still be set)
        self.stale = 0
        self.rebuilds = 0
        self._snapshot: list[BlockHash] | None = None  # a rebuild's blocks, read from _pos on
        self._pos = 0
        self._next: np.ndarray | None = None  # a rebuild's bits

    def _set(self, into: np.ndarray, keys: Collection[BlockHash]) -> None:
        """Set ``keys``' bits in ``into`` (one vectorized pass; ~50 us for 1024 keys)."""
        if not keys:
            return
        idx = np.frombuffer(b"".join(map(key_bytes, keys)), dtype="<u8") & self._mask
        np.bitwise_or.at(into, (idx >> np.uint64(3)).astype(np.intp),
                         np.left_shift(np.uint8(1), (idx & np.uint64(7)).astype(np.uint8)))

    def add(self, keys: Collection[BlockHash]) -> None:
        """``keys`` may become matchable from now on."""
        assert self._bits is not None, "closed"
        self._set(self._bits, keys)
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
            if self.stale < max(MIN_STALE, len(live)):
                return
            self._snapshot, self._pos, self._next = list(live), 0, np.zeros(self.bits // 8, dtype=np.uint8)
            log.debug("presence filter: rebuilding from %d blocks (%d stale)", len(live), self.stale)
            self.stale = 0  # blocks forgotten from now on may be in the snapshot
        assert self._next is not None and self._bits is not None
        end = min(len(self._snapshot), self._pos + REBUILD_SLICE)
        self._set(self._next, self._snapshot[self._pos:end])
        self._pos = end
        if end == len(self._snapshot):
            self._bits[:] = self._next  # every byte old or new: a block held throughout reads set
            self._snapshot, self._next = None, None
            self.rebuilds += 1

    def clear(self) -> None:
        """Every block is gone: zero the bits (a rebuild in progress is dropped)."""
        assert self._bits is not None, "closed"
        self._bits[:] = 0
        self._snapshot, self._next, self.stale = None, None, 0

    def may_hold(self, key: BlockHash) -> bool:
        assert self._bits is not None, "closed"
        idx = np.frombuffer(key_bytes(key), dtype="<u8") & self._mask
        return bool(np.all(self._bits[(idx >> np.uint64(3)).astype(np.intp)] >> (idx & np.uint64(7)).astype(np.uint8) & 1))

    def close(self) -> None:
        """Remove the file (clients keep their mapping of the last bits) and unmap it; idempotent."""
        if self._mm.closed:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._bits = self._next = None  # (the mapping cannot close while an array views it)
        self._mm.close()


def remove_stale_files(directory: str) -> None:
    """Remove filters earlier leaders left in ``directory`` (one leader per socket directory)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith("presence-") and name.endswith(".bits"):
            try:
                os.unlink(os.path.join(directory, name))
                log.info("removed %s, an earlier leader's presence filter", name)
            except OSError:
                pass
