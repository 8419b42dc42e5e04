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
  from the registry's blocks in slices of :data:`REBUILD_SLICE` (a few ms each, at each flush),
  into a private copy that also takes the blocks added meanwhile; the copy then replaces the
  file's bits in one copy. A block present throughout has its bits set in both, so no reader
  ever sees it cleared;
* ``clear`` (every block of the node gone: a worker lost, pools re-planned) zeroes the bits.

Owns the file (created 0600, removed on close) and its mapping.
"""
from __future__ import annotations

import logging
import mmap
import os
from typing import Collection

from kvbm_client.ids import BlockHash
from kvbm_client.presence import HEADER_BYTES, check_bits, file_name, header, probes

log = logging.getLogger("kvbm.leader")

#: blocks a rebuild reads per flush (~0.7 us each)
REBUILD_SLICE = 8192
#: fewest stale blocks that start a rebuild
MIN_STALE = 4096


class PresenceFilter:
    """The leader's writable filter of ``bits`` bits in ``directory``."""

    def __init__(self, directory: str, bits: int, leader_id: str) -> None:
        check_bits(bits)
        self.bits = bits
        self._mask = bits - 1
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
        #: blocks gone since the last rebuild began (their bits may still be set)
        self.stale = 0
        self.rebuilds = 0
        self._snapshot: list[BlockHash] | None = None  # a rebuild's blocks, read from _pos on
        self._pos = 0
        self._next: bytearray | None = None  # a rebuild's bits

    def add(self, keys: Collection[BlockHash]) -> None:
        """``keys`` became matchable."""
        mm, mask, nxt = self._mm, self._mask, self._next
        for key in keys:
            for i in probes(key, mask):
                at = HEADER_BYTES + (i >> 3)
                mm[at] |= 1 << (i & 7)
                if nxt is not None:
                    nxt[i >> 3] |= 1 << (i & 7)

    def gone(self, count: int) -> None:
        """``count`` blocks were forgotten (no copy left)."""
        self.stale += count

    def step(self, live: Collection[BlockHash]) -> None:
        """Advance a rebuild by one slice, or start one when the stale blocks call for it
        (``live``: every block the leader holds now, e.g. the registry's ``parents``)."""
        if self._snapshot is None:
            if self.stale < max(MIN_STALE, len(live)):
                return
            self._snapshot, self._pos, self._next = list(live), 0, bytearray(self.bits // 8)
            log.debug("presence filter: rebuilding from %d blocks (%d stale)", len(live), self.stale)
            self.stale = 0  # blocks forgotten from now on may be in the snapshot
        snapshot, nxt, mask = self._snapshot, self._next, self._mask
        assert nxt is not None
        end = min(len(snapshot), self._pos + REBUILD_SLICE)
        for key in snapshot[self._pos:end]:
            for i in probes(key, mask):
                nxt[i >> 3] |= 1 << (i & 7)
        self._pos = end
        if end == len(snapshot):
            self._mm[HEADER_BYTES:] = nxt
            self._snapshot, self._next = None, None
            self.rebuilds += 1

    def clear(self) -> None:
        """Every block is gone: zero the bits (a rebuild in progress is dropped)."""
        self._mm[HEADER_BYTES:] = bytes(self.bits // 8)
        self._snapshot, self._next, self.stale = None, None, 0

    def may_hold(self, key: BlockHash) -> bool:
        i, j = probes(key, self._mask)
        mm = self._mm
        return bool(mm[HEADER_BYTES + (i >> 3)] >> (i & 7) & 1 and mm[HEADER_BYTES + (j >> 3)] >> (j & 7) & 1)

    def close(self) -> None:
        """Remove the file (clients keep their mapping of the last bits) and unmap it; idempotent."""
        if self._mm.closed:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
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
