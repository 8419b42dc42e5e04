"""The leader's presence filter, as its clients read it: "may this block be stored?" without a
round trip.

A cold request (no block of it stored) costs a connector a ``PrepareLoad`` round trip before the
engine can schedule it: 2-5 ms for a 20K-token prompt on an H100 host, plus the hashing of every
block the call carries. A lookup matches a *prefix*, so the answer is "nothing" exactly when the
first block asked for is not stored. The leader keeps a Bloom filter of every block it can
serve in a file in its socket directory (:mod:`kvbm_leader.presence` writes it); a client maps it
read-only and answers a lookup whose first block the filter rules out as a miss itself.

The filter may say "maybe" for a block that is not stored (then the client asks, as without a
filter), never "no" for a block a lookup would match: the leader sets a block's slots before it
answers any lookup that could match it, and clears slots only by rebuilding the whole filter
from the blocks it holds. A reader that sees "no" for a block stored meanwhile (a race of a few
microseconds) misses it once: the engine recomputes; nothing is ever served from the filter.

File (``presence-<socket dir digest>-<leader pid>-<leader id>.bits``, mode 0600, in ``/dev/shm/kvbm-UID``, a
0700 directory, or in the leader's socket directory where there is no /dev/shm): a 64-byte
header (:data:`MAGIC`, the slot count, the probes per key (2), the leader's id), then one byte
per slot, 0 or 1 (a byte, not a bit: the leader sets a store's slots in one vectorized
assignment, with no read-modify-write of bytes that other keys share). A key's two probes are
its two words (:func:`words`) modulo the slot count, a power of two.
"""
from __future__ import annotations

import hashlib
import logging
import mmap
import os
import stat
import struct

from .ids import BlockHash

log = logging.getLogger("kvbm")

MAGIC = b"KVBMPRS1"
HEADER_BYTES = 64
PROBES = 2
_HEADER = struct.Struct("<8sQI4x40s")  # magic, slots, probes, (pad), leader id (ascii, NUL-padded)
MIN_SLOTS = 1 << 16
MAX_SLOTS = 1 << 30
#: odd 64-bit constant (2^64 / golden ratio): an 8-byte key's second word is its first times this
MIX = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1


def check_slots(slots: int) -> None:
    """Raise ValueError unless ``slots`` is a power of two in [:data:`MIN_SLOTS`, :data:`MAX_SLOTS`]."""
    if slots < MIN_SLOTS or slots > MAX_SLOTS or slots & (slots - 1):
        raise ValueError(f"presence filter slots must be a power of two from {MIN_SLOTS} to {MAX_SLOTS}, not {slots}")


def header(slots: int, leader_id: str) -> bytes:
    ident = leader_id.encode("ascii")
    if len(ident) > 40:
        raise ValueError(f"leader id {leader_id!r} longer than 40 bytes")
    return _HEADER.pack(MAGIC, slots, PROBES, ident).ljust(HEADER_BYTES, b"\0")


def words(key: bytes) -> tuple[int, int]:
    """``key``'s two 64-bit words, whose low bits are its probes: its first 16 bytes as two
    little-endian words (kvbm's 16-byte BLAKE2b keys: already uniform); an 8-byte key (Dynamo's
    xxh3-64 sequence hashes) and its product with :data:`MIX`; any other its 16-byte BLAKE2b."""
    if len(key) >= 16:
        return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little")
    if len(key) == 8:
        h = int.from_bytes(key, "little")
        return h, h * MIX & _U64
    d = hashlib.blake2b(key, digest_size=16).digest()
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


def probes(key: bytes, mask: int) -> tuple[int, int]:
    """The two slots of ``key`` in a filter of ``mask + 1`` slots."""
    a, b = words(key)
    return a & mask, b & mask


class PresenceView:
    """A client's read-only map of the leader's filter. Owns the mapping."""

    def __init__(self, mapped: mmap.mmap, slots: int) -> None:
        self._mm = mapped
        self._mask = slots - 1

    @classmethod
    def open(cls, path: str, slots: int, leader_id: str) -> "PresenceView | None":
        """Map the filter the leader ``leader_id`` announced; None (and a log line) when it is
        not there, not a regular file of the announced size, or not that leader's."""
        if not path:
            return None
        try:
            check_slots(slots)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (OSError, ValueError) as exc:
            log.info("kvbm: the leader's presence filter %s is not readable here (%s); every lookup asks it", path, exc)
            return None
        try:
            st = os.fstat(fd)
            size = HEADER_BYTES + slots
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                log.warning("kvbm: %s is not a presence filter of %d slots; every lookup asks the leader", path, slots)
                return None
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as exc:
            log.warning("kvbm: cannot map the presence filter %s (%s); every lookup asks the leader", path, exc)
            return None
        finally:
            os.close(fd)
        if mapped[:HEADER_BYTES] != header(slots, leader_id):
            mapped.close()
            log.warning("kvbm: %s is not leader %s's presence filter; every lookup asks the leader", path, leader_id)
            return None
        return cls(mapped, slots)

    def may_hold(self, key: BlockHash) -> bool:
        """False: the leader holds no copy of ``key`` (a lookup starting there matches nothing).
        True ("maybe": ask the leader) once the view is closed, also by another thread meanwhile."""
        i, j = probes(key, self._mask)
        try:
            return bool(self._mm[HEADER_BYTES + i] and self._mm[HEADER_BYTES + j])
        except ValueError:  # closed (a re-opened session replaced it)
            return True

    def close(self) -> None:
        """Unmap; idempotent."""
        self._mm.close()
