"""Checksums of a worker tier's slots: xxh3-64 over each slot's block bytes.

Runs in the worker daemon, on the lane threads (the table is only touched by copies, which
the lanes serialize per direction; a slot is written by one job at a time since the leader
hands it to one job at a time). Every G3 slot has one: computed when the slot is written to
disk (store to disk, demotion), checked on every read (load from disk, promotion). G2 slots
have one with ``DYN_KVBM_HOST_CHECKSUMS``.

Invariant: ``valid[s]`` is True only while ``sums[s]`` is the checksum of the bytes the
worker last wrote to slot ``s``. A slot is forgotten before it is rewritten, so a write that
fails or never returns leaves it invalid, and an invalid slot never verifies. With
``DYN_KVBM_DISK_PERSIST`` the G3 table is a :class:`~.disk_index.PersistentSlotSums`, which
keeps the same table durable beside the G3 file.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt
import xxhash

from .id_arrays import Slots
from .jobs import JobKey

Rows = npt.NDArray[np.uint8]  # 2-D: one slot per row (a pool's slots or a bounce buffer)
Ids = npt.NDArray[np.int64]
Sums = npt.NDArray[np.uint64]


def digest(rows: Rows, picks: Ids, nbytes: int) -> Sums:
    """xxh3-64 of ``rows[picks[i], :nbytes]`` for every i."""
    out = np.empty(len(picks), np.uint64)
    for i, r in enumerate(picks.tolist()):
        out[i] = xxhash.xxh3_64_intdigest(rows[r, :nbytes].data)
    return out


class SlotSums:
    """The checksum table of one tier (see the module docstring)."""

    def __init__(self, num_slots: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.sums: Sums = np.zeros(num_slots, np.uint64)
        self.valid = np.zeros(num_slots, bool)

    def forget(self, slots: Slots) -> None:
        self.valid[slots] = False

    def reset(self) -> None:
        """Every slot's contents are void (a new pool epoch)."""
        self.valid[:] = False

    def record(self, slots: Slots, sums: Sums, writer: JobKey | None = None) -> None:
        """``sums`` are the checksums of what was just written to ``slots`` (by ``writer``'s job)."""
        self.sums[slots] = sums
        self.valid[slots] = True

    def seal(self, slots: Slots, rows: Rows, picks: Ids) -> Sums:
        """Record the checksums of ``rows[picks]`` as those of ``slots``; returns them."""
        sums = digest(rows, picks, self.block_bytes)
        self.record(slots, sums)
        return sums

    def mismatches(self, slots: Slots, sums: Sums) -> Slots:
        """The slots whose recorded checksum is missing or differs from ``sums``."""
        bad = ~self.valid[slots] | (self.sums[slots] != sums)
        return Slots(slots[bad])

    def verify(self, slots: Slots, rows: Rows, picks: Ids) -> tuple[Slots, Sums]:
        """Check ``rows[picks]`` against the checksums of ``slots``: (bad slots, computed sums)."""
        sums = digest(rows, picks, self.block_bytes)
        return self.mismatches(slots, sums), sums
