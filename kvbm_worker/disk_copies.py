"""The G3 side of the copy executor: every byte that reaches or leaves the disk file, engine
<-> G3 through a lane's bounce buffer (:mod:`.bounce`), G2 -> G3 demotions and G3 -> G2
promotions.

A base of :class:`~.mover.BlockMover`, synchronous on a lane thread like the mover's ``run``;
the disk calls are :class:`~.handlers.disk_guard.TimedDiskIO`'s (each with a time limit). What
it uses of the mover (the pools, the bounce buffers, the checksum tables, the time check and
the medium's engine copies) is declared here and defined there.

Pipelines: a store's engine copy of chunk k+1 (into one bounce half) overlaps the disk write of
chunk k; a load's disk read (and check) of chunk k+1 overlaps the engine copy of chunk k. A
promotion reads through the bounce rows, never straight into a G2 slot (a read that never
returns could write the slot after the leader reused it). Consecutive slots at consecutive
addresses are one I/O.

Invariants: every pass starts with ``TimedDiskIO.check`` (a stuck call may still use the bounce
rows); no engine copy still writes a bounce row once a pass returns or raises; a G3 slot's
checksum is forgotten before it is written and recorded after, and every read is verified
before its bytes reach the engine or G2. A failed read raises :class:`~.errors.SlotsFailed`:
after a timeout naming every slot of the read, after another ``OSError`` those that fail alone
(a truncated file; all if none does); :class:`~.handlers.disk_guard.DiskHung` (nothing was read)
passes through.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvbm_client.ids import Tier

from .bounce import BounceBuffer
from .checksums import SlotSums, digest
from .errors import SlotsFailed
from .handlers.disk_guard import DiskHung, DiskTimeout, TimedDiskIO
from .id_arrays import EngineBlocks, Slots
from .jobs import JobKey
from .lanes import Lane
from .pending import Pending
from .plan_check import Batch
from .pools import DiskPool, HostPool
from .regions import EngineRegion
from .runs import chunks, segments

Ids = npt.NDArray[np.int64]
Rows = npt.NDArray[np.uint8]


class DiskCopies:
    """The G3 passes of a :class:`~.mover.BlockMover` (its state is the mover's: see there)."""

    host: HostPool | None
    disk: DiskPool | None
    disk_io: TimedDiskIO | None
    bounce: dict[Lane, BounceBuffer]
    disk_sums: SlotSums | None
    host_sums: SlotSums | None

    if TYPE_CHECKING:  # the mover's (BlockMover defines them)
        def _check_time(self, until: float) -> None: ...

        def _pool(self) -> HostPool: ...

        @staticmethod
        def _verify(sums: SlotSums, tier: Tier, slots: Slots, rows: Rows, picks: Ids) -> npt.NDArray[np.uint64]: ...

        def _to_slots(self, region: EngineRegion, blocks: EngineBlocks, rows: Rows, picks: Ids) -> Pending: ...

        def _from_slots(self, region: EngineRegion, blocks: EngineBlocks, rows: Rows, picks: Ids,
                        pages: tuple[int, int] | None = None, timed: bool = False) -> Pending: ...

    # ------------------------------------------------------------------ G3 I/O
    def _disk_io(self) -> TimedDiskIO:
        assert self.disk_io is not None and self.disk is not None, "a plan names G3 on a worker without G3"
        return self.disk_io

    def _sums(self) -> SlotSums:
        assert self.disk_sums is not None, "a plan names G3 on a worker without G3"
        return self.disk_sums

    def _disk_runs(self, addrs: Ids, slots: Slots) -> tuple[list[int], list[int], list[int]]:
        """Consecutive slots at consecutive addresses become one I/O."""
        assert self.disk is not None
        unit = self.disk.geometry.slot_bytes
        a, o, n = segments(addrs, slots * unit, unit)
        return a.tolist(), o.tolist(), n.tolist()

    def _write_disk(self, addrs: Ids, slots: Slots, sums: npt.NDArray[np.uint64], hold: object,
                    writer: JobKey) -> None:
        """Host memory at ``addrs`` -> G3 ``slots`` for ``writer``'s job (checksums ``sums``)."""
        table = self._sums()
        table.forget(slots)
        self._disk_io().write(*self._disk_runs(addrs, slots), hold=hold)
        table.record(slots, sums, writer)

    def _read_rows(self, bounce: BounceBuffer, rows: Ids, slots: Slots) -> npt.NDArray[np.uint64]:
        """Read G3 ``slots`` into ``bounce`` rows and verify them; returns their checksums."""
        try:
            self._disk_io().read(*self._disk_runs(bounce.address(rows), slots), hold=bounce.slots)
        except DiskTimeout as exc:
            raise SlotsFailed(Tier.DISK, slots.tolist(), f"could not be read: {exc}") from None
        except DiskHung:
            raise  # nothing was read: the slots are not at fault
        except OSError as exc:
            raise SlotsFailed(Tier.DISK, self._unreadable(bounce, rows, slots), f"could not be read: {exc}") from None
        return self._verify(self._sums(), Tier.DISK, slots, bounce.slots, rows)

    def _unreadable(self, bounce: BounceBuffer, rows: Ids, slots: Slots) -> list[int]:
        """After a failed read of several slots (a truncated file): those that fail alone (read or
        checksum), so only their copies are dropped (all if the disk fails every one)."""
        bad: list[int] = []
        for i in range(len(slots)):
            one, row = Slots(slots[i:i + 1]), rows[i:i + 1]
            try:
                self._disk_io().read(*self._disk_runs(bounce.address(row), one), hold=bounce.slots)
            except DiskHung:
                raise
            except OSError:
                bad.append(int(one[0]))
                continue
            mismatched, _ = self._sums().verify(one, bounce.slots, row)
            bad.extend(int(s) for s in mismatched)
        return bad or slots.tolist()

    def _store_disk(self, region: EngineRegion, blocks: EngineBlocks, slots: Slots, until: float,
                    writer: JobKey) -> None:
        """The engine copy of chunk k+1 (into one bounce half) overlaps the disk write of chunk k."""
        self._disk_io().check()  # a stuck call may still use the bounce rows
        bounce = self.bounce[Lane.STORE]
        issued: list[Pending] = []
        pending: tuple[Pending, Ids, Slots] | None = None

        def write_out(copy: Pending, rows: Ids, to: Slots) -> None:
            copy.wait()
            self._check_time(until)
            sums = digest(bounce.slots, rows, self._sums().block_bytes)
            self._write_disk(bounce.address(rows), to, sums, bounce.slots, writer)

        try:
            for k, (lo, hi) in enumerate(chunks(len(blocks), bounce.per_chunk)):
                rows = bounce.rows(k, hi - lo)
                if pending is not None and not bounce.overlaps:
                    write_out(*pending)
                    pending = None
                issued.append(self._to_slots(region, EngineBlocks(blocks[lo:hi]), bounce.slots, rows))
                if pending is not None:
                    write_out(*pending)
                pending = (issued[-1], rows, Slots(slots[lo:hi]))
            if pending is not None:
                write_out(*pending)
        finally:
            for copy in issued:  # no engine copy may still write a bounce row after we return
                copy.wait()

    def _load_disk(self, region: EngineRegion, blocks: EngineBlocks, slots: Slots, until: float) -> None:
        """The disk read (and check) of chunk k+1 overlaps the engine copy of chunk k."""
        self._disk_io().check()
        bounce = self.bounce[Lane.LOAD]
        inflight: list[Pending | None] = [None, None]
        try:
            for k, (lo, hi) in enumerate(chunks(len(blocks), bounce.per_chunk)):
                for half in ((k % 2,) if bounce.overlaps else (0, 1)):
                    copy = inflight[half]
                    if copy is not None:
                        copy.wait()
                        inflight[half] = None
                rows = bounce.rows(k, hi - lo)
                self._check_time(until)
                self._read_rows(bounce, rows, Slots(slots[lo:hi]))
                inflight[k % 2] = self._from_slots(region, EngineBlocks(blocks[lo:hi]), bounce.slots, rows)
        finally:
            for copy in inflight:
                if copy is not None:
                    copy.wait()
        self._check_time(until)

    # ------------------------------------------------------------------ G2 <-> G3
    def _demote(self, batch: Batch, until: float) -> int:
        """G2 -> G3, straight from the host slots (verified first with host checksums)."""
        if not len(batch.demote_host):
            return 0
        self._disk_io().check()
        host, per = self._pool(), self.bounce[batch.lane].per_chunk
        for lo, hi in chunks(len(batch.demote_host), per):
            self._check_time(until)
            h, d = Slots(batch.demote_host[lo:hi]), Slots(batch.demote_disk[lo:hi])
            if self.host_sums is not None:
                sums = self._verify(self.host_sums, Tier.HOST, h, host.slots, h)
            else:
                sums = digest(host.slots, h, self._sums().block_bytes)
            self._write_disk(host.address + h * host.geometry.slot_bytes, d, sums, host.buffer, batch.job)
        return len(batch.demote_host) * host.geometry.block_bytes

    def _promote(self, batch: Batch, until: float) -> int:
        """G3 -> G2 through the lane's bounce rows (verified before a byte reaches G2): a read
        straight into a slot that never returns could write it after the leader reused it."""
        if not len(batch.promote_host):
            return 0
        self._disk_io().check()
        host, bounce = self._pool(), self.bounce[batch.lane]
        assert host.geometry.slot_bytes == bounce.slots.shape[1]
        for k, (lo, hi) in enumerate(chunks(len(batch.promote_host), bounce.per_chunk)):
            self._check_time(until)
            h, d = Slots(batch.promote_host[lo:hi]), Slots(batch.promote_disk[lo:hi])
            rows = bounce.rows(k, hi - lo)
            sums = self._read_rows(bounce, rows, d)
            if self.host_sums is not None:
                self.host_sums.forget(h)
            host.slots[h] = bounce.slots[rows]
            if self.host_sums is not None:
                self.host_sums.record(h, sums)
        return len(batch.promote_host) * host.geometry.block_bytes
