"""The leader's presence filter, as its clients read it: "may this block be stored?" without a
round trip.

A cold request (no block of it stored) costs a connector a ``PrepareLoad`` round trip before the
engine can schedule it: 2-5 ms for a 20K-token prompt on an H100 host, plus the hashing of every
block the call carries. A lookup matches a *prefix*, so the answer is "nothing" exactly when the
first block asked for is not stored. The leader keeps a Bloom filter of every block it can
serve in a file in its socket directory (:mod:`kvbm_leader.presence` writes it); a client maps it
read-only and answers a lookup whose first block the filter rules out as a miss itself.

The filter may say "maybe" for a block that is not stored (then the client asks, as without a
filter), never "no" for a block a lookup would match: the leader sets a block's bits before it
answers any lookup that could match it, and clears bits only by rebuilding the whole filter
from the blocks it holds. A reader that sees "no" for a block stored meanwhile (a race of a few
microseconds) misses it once: the engine recomputes; nothing is ever served from the filter.

File (``presence-<leader id>.bits``, mode 0600 in the leader's socket directory): a 64-byte
header (:data:`MAGIC`, the bit count, the probes per key (2), the leader's id), then the bits.
Bit ``i`` is bit ``i % 8`` of byte ``i // 8``. A key's two probes are its first two 8-byte
little-endian words (kvbm's keys are BLAKE2b outputs; a shorter key is hashed first) modulo
the bit count, a power of two.
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
_HEADER = struct.Struct("<8sQI4x40s")  # magic, bits, probes, (pad), leader id (ascii, NUL-padded)
MIN_BITS = 1 << 16
MAX_BITS = 1 << 34


def file_name(leader_id: str) -> str:
    return f"presence-{leader_id}.bits"


def check_bits(bits: int) -> None:
    """Raise ValueError unless ``bits`` is a power of two in [:data:`MIN_BITS`, :data:`MAX_BITS`]."""
    if bits < MIN_BITS or bits > MAX_BITS or bits & (bits - 1):
        raise ValueError(f"presence filter bits must be a power of two from {MIN_BITS} to {MAX_BITS}, not {bits}")


def header(bits: int, leader_id: str) -> bytes:
    ident = leader_id.encode("ascii")
    if len(ident) > 40:
        raise ValueError(f"leader id {leader_id!r} longer than 40 bytes")
    return _HEADER.pack(MAGIC, bits, PROBES, ident).ljust(HEADER_BYTES, b"\0")


def key_bytes(key: bytes) -> bytes:
    """The 16 bytes whose two little-endian words are ``key``'s probes (before the mask)."""
    if len(key) == 16:
        return key
    return key[:16] if len(key) > 16 else hashlib.blake2b(key, digest_size=16).digest()


def probes(key: bytes, mask: int) -> tuple[int, int]:
    """The two bit indices of ``key`` in a filter of ``mask + 1`` bits."""
    key = key_bytes(key)
    return int.from_bytes(key[:8], "little") & mask, int.from_bytes(key[8:16], "little") & mask


class PresenceView:
    """A client's read-only map of the leader's filter. Owns the mapping."""

    def __init__(self, mapped: mmap.mmap, bits: int) -> None:
        self._mm = mapped
        self._mask = bits - 1

    @classmethod
    def open(cls, path: str, bits: int, leader_id: str) -> "PresenceView | None":
        """Map the filter the leader ``leader_id`` announced; None (and a log line) when it is
        not there, not a regular file of the announced size, or not that leader's."""
        if not path:
            return None
        try:
            check_bits(bits)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (OSError, ValueError) as exc:
            log.info("kvbm: the leader's presence filter %s is not readable here (%s); every lookup asks it", path, exc)
            return None
        try:
            st = os.fstat(fd)
            size = HEADER_BYTES + bits // 8
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                log.warning("kvbm: %s is not a presence filter of %d bits; every lookup asks the leader", path, bits)
                return None
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as exc:
            log.warning("kvbm: cannot map the presence filter %s (%s); every lookup asks the leader", path, exc)
            return None
        finally:
            os.close(fd)
        if mapped[:HEADER_BYTES] != header(bits, leader_id):
            mapped.close()
            log.warning("kvbm: %s is not leader %s's presence filter; every lookup asks the leader", path, leader_id)
            return None
        return cls(mapped, bits)

    def may_hold(self, key: BlockHash) -> bool:
        """False: the leader holds no copy of ``key`` (a lookup starting there matches nothing)."""
        i, j = probes(key, self._mask)
        mm = self._mm
        return bool(mm[HEADER_BYTES + (i >> 3)] >> (i & 7) & 1 and mm[HEADER_BYTES + (j >> 3)] >> (j & 7) & 1)

    def close(self) -> None:
        self._mm.close()
