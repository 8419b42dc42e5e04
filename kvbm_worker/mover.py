"""The copy executor: moves the bytes of checked batches between the engine region, G2 (host
slots) and G3 (the disk file, through a bounce buffer), verifying G3 (and optionally G2).

Runs in the worker daemon; :meth:`BlockMover.run` is synchronous, on a lane thread (:mod:`.lanes`).
A template: this class does the tier split, the engine <-> G2 copies, checksums and time checks,
its base :class:`~.disk_copies.DiskCopies` the G3 side (demotions, promotions, the bounce-buffer
pipeline to and from disk); a medium supplies how engine pages reach slot rows
(:meth:`_to_slots` / :meth:`_from_slots`: numpy on a CPU engine's shared memory here,
:class:`~.handlers.cuda.CudaMover` for CUDA IPC regions). A G2 store's pieces wait while a load
runs (:mod:`.loads_first`).

Order within a batch: demotions, promotions, then the entries (a STORE may reuse the host slot
of a block it first demotes to disk).

Layer groups (a G2 LOAD with a :class:`~.grouping.Grouping`): ``Grouping.landed`` gets a group's
end page once its bytes are in the engine's memory, the signal words (:mod:`.signals`) are
written after its copies; the time check at the end still decides the outcome. A staged load
(:mod:`.stages`: :meth:`BlockMover.stage` copied its first groups into the staging area before
the blocks were known) takes those groups from the area, one scatter per group.

Integrity (every G3 slot; G2 slots with ``host_checksums``): a slot's xxh3-64 is computed from
the bytes written (:mod:`.checksums`) and checked after every read, before the bytes reach the
engine or G2; a mismatch or a failed read raises :class:`~.errors.SlotsFailed` naming the slots.

Time (``until``: the job's deadline plus part of the leader's grace, after which the leader may
reuse the job's slots): checked before every chunk is written and after a load read its sources,
so a late copy stops instead of landing in a reused slot (:class:`~.errors.CopyExpired`).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvbm_client.ids import PlanKind, Tier

from .bounce import BounceBuffer
from .checksums import SlotSums
from .errors import CopyExpired, SlotsFailed
from .handlers import cpu
from .disk_copies import DiskCopies
from .handlers.disk_guard import TimedDiskIO
from .id_arrays import EngineBlocks, Slots
from .grouping import DMA_FLOOR_BPS, GroupPacing, Grouping as Grouping, group_pieces, groupable
from .jobs import PieceTimes, ThreadUsage
from .lanes import Lane
from .loads_first import STORE_YIELD_MS, LoadsFirst
from .pending import DONE, Pending
from .plan_check import Batch
from .pools import DiskPool, HostPool
from .regions import EngineRegion
from .runs import chunks
from .signals import SignalWriter
from .stages import StageLayout

log = logging.getLogger("kvbm.worker")

Ids = npt.NDArray[np.int64]
Rows = npt.NDArray[np.uint8]
HOST_CHUNK_BYTES = 256 << 20  # engine <-> G2 copies are cut here, to check the time in between


class BlockMover(DiskCopies):
    """Moves bytes for one worker's pools (one pool epoch). Owns the bounce buffers and the G2
    checksum table; borrows the pools (None: a tier is off; the G3 table belongs to the G3 file)
    and the timed G3 I/O. ``host_checksums``: ``DYN_KVBM_HOST_CHECKSUMS``; ``clock``: monotonic;
    ``store_yield_ms``: a store job's longest wait for loads (:mod:`.loads_first`)."""

    def __init__(self, host: HostPool | None, disk: DiskPool | None, disk_io: TimedDiskIO | None, *,
                 host_checksums: bool = False, bounce_slots: int = 64, pacing: GroupPacing = GroupPacing(),
                 clock: Callable[[], float] = time.monotonic, store_yield_ms: float = STORE_YIELD_MS,
                 stage_bytes: int = 0) -> None:
        self.host, self.disk, self.disk_io = host, disk, disk_io
        self.stage_bytes = stage_bytes  # the staging area's size (:mod:`.stages`); 0: none
        self._host_area: npt.NDArray[np.uint8] | None = None  # the CPU medium's, made at its first stage
        self.pacing = pacing
        self.clock = clock
        self.loads_first = LoadsFirst(store_yield_ms / 1e3, clock)
        self.bounce: dict[Lane, BounceBuffer] = {}
        self.disk_sums = disk.sums if disk else None
        self.host_sums = SlotSums(host.geometry.num_slots, host.geometry.block_bytes) \
            if host is not None and host_checksums else None
        if disk is not None and disk_io is not None:
            n = max(1, min(bounce_slots, disk.geometry.num_slots))
            for lane in Lane:
                buf = self.bounce[lane] = BounceBuffer(disk.geometry.slot_bytes, n)
                disk_io.register(buf.slots.ctypes.data, buf.slots.nbytes)
            if host is not None:
                disk_io.register(host.address, host.buffer.nbytes)

    def renew(self) -> None:
        """The pools' contents are void (a new epoch with the same geometry)."""
        for sums in (self.disk_sums, self.host_sums):
            if sums is not None:
                sums.reset()

    def warm_lane(self, lane: Lane) -> None:
        """Once on each lane thread before its first job: per-thread first-use costs (none on the CPU)."""

    # ------------------------------------------------------------------ medium hooks
    def _enter_lane(self, region: EngineRegion | None) -> None:
        """Per-batch set-up on the lane thread (a CUDA device)."""

    def _to_slots(self, region: EngineRegion, blocks: EngineBlocks, rows: Rows, picks: Ids) -> Pending:
        """``rows[picks[i]]`` <- every layer's page of engine block ``blocks[i]``."""
        cpu.gather(region, blocks, rows, picks)
        return DONE

    def _from_slots(self, region: EngineRegion, blocks: EngineBlocks, rows: Rows, picks: Ids,
                    pages: tuple[int, int] | None = None, timed: bool = False) -> Pending:
        """Every layer's page (``pages``: those in ``[lo, hi)``) of engine block ``blocks[i]``
        <- ``rows[picks[i]]``. ``timed``: the copy will be asked :meth:`_gpu_ms`."""
        cpu.scatter(rows, picks, region, blocks, pages)
        return DONE

    def stage_refusal(self, region: EngineRegion) -> str | None:
        """Why no load into ``region`` can be staged here (None: one can, if it fits the area)."""
        return None if self.stage_bytes else "this worker has no staging area (kvbm-worker --stage-mib 0)"

    def _to_stage(self, region: EngineRegion, rows: Rows, picks: Ids, layout: StageLayout) -> None:
        """Group ``g < layout.staged`` of slot row ``rows[picks[i]]`` -> the staging area at
        ``layout``'s offsets (issued on the stream the load's own copies follow: not waited for)."""
        if self._host_area is None:
            self._host_area = np.empty(self.stage_bytes, np.uint8)
        p = layout.page_bytes
        for g in range(layout.staged):
            first, end = layout.pages(g)
            off, size = layout.group_offset(g), layout.group_bytes(g)
            self._host_area[off:off + layout.blocks * size].reshape(layout.blocks, size)[:] = \
                rows[picks, first * p:end * p]

    def _from_stage(self, region: EngineRegion, blocks: EngineBlocks, layout: StageLayout, g: int,
                    timed: bool = False) -> Pending:
        """Staged group ``g`` of every block -> those pages of engine block ``blocks[i]``."""
        assert self._host_area is not None, "a staged group without a staging area"
        first, end = layout.pages(g)
        off, n = layout.group_offset(g), layout.blocks
        src = self._host_area[off:off + n * layout.group_bytes(g)].reshape(n, end - first, layout.page_bytes)
        for layer in range(first, end):
            region.layer_views[layer][blocks] = src[:, layer - first]
        return DONE

    def _signal(self, region: EngineRegion, slot: int, value: int) -> Pending:
        """Write word ``slot`` of the region's signal page after every copy issued so far
        (:mod:`.signals`); here those copies are done: a CPU store."""
        assert region.signals is not None, "signal words name a region without a signal page"
        region.signals.store(slot, value)
        return DONE

    def _gpu_mark(self) -> object | None:
        """A mark of the medium's clock at the job's start (None: this medium has none; the CPU copies)."""
        return None

    def _gpu_ms(self, mark: object, copy: Pending) -> float | None:
        """Ms from ``mark`` to the end of ``copy`` (a timed one that completed) on the medium's clock."""
        return None

    # ------------------------------------------------------------------ the template
    def run(self, batch: Batch, region: EngineRegion | None, until: float, grouping: Grouping | None = None,
            staged: StageLayout | None = None) -> int:
        """Execute ``batch``; returns the bytes moved. Raises :class:`SlotsFailed`,
        :class:`CopyExpired`, ``OSError`` (disk) or the medium's errors. ``grouping``: a LOAD
        whose entries are all in G2 runs in those page groups (else it is ignored); ``staged``:
        with ``grouping`` of the same bounds, its staged groups come from the staging area."""
        self._enter_lane(region)
        moved = self._demote(batch, until) + self._promote(batch, until)
        if batch.kind in (PlanKind.DEMOTE, PlanKind.PROMOTE):
            return moved
        assert region is not None
        region.check_blocks(batch.engine_blocks)
        for tier in (Tier.HOST, Tier.DISK):
            blocks, slots = batch.entries(tier)
            if not len(blocks):
                continue
            if tier is Tier.HOST:  # (not G3 loads: disk speed)
                with self.loads_first.loading(batch.kind is PlanKind.LOAD):
                    grouped = grouping if groupable(batch) else None
                    self._engine_host(batch.kind, region, blocks, slots, until, grouped,
                                      staged if grouped is not None else None)
            elif batch.kind is PlanKind.STORE:
                self._store_disk(region, blocks, slots, until, batch.job)
            else:
                self._load_disk(region, blocks, slots, until)
            moved += len(blocks) * region.block_bytes
        return moved

    def stage(self, batch: Batch, region: EngineRegion, until: float, layout: StageLayout) -> None:
        """On the load lane, after the leader's go: issue the copies of ``batch``'s staged groups
        into the staging area (:mod:`.stages`), not waited for."""
        self._enter_lane(region)
        self._check_time(until)
        host, sums = self._pool(), self.host_sums
        slots = batch.slots  # (a stage's entries are all in G2: plan_check.check_stage)
        if sums is not None:  # (checked again when the groups land: the slots are the job's until then)
            for lo, hi in chunks(len(slots), HOST_CHUNK_BYTES // region.block_bytes):
                self._verify(sums, Tier.HOST, Slots(slots[lo:hi]), host.slots, Slots(slots[lo:hi]))
        self._to_stage(region, host.slots, slots, layout)

    def _timed(self, mark: object | None, copy: Pending) -> float | None:
        """:meth:`_gpu_ms` for the debug log's piece times; a timing that fails is left out (a
        log line is never worth failing a job: an H100 run's staged jobs all failed on one)."""
        if mark is None:
            return None
        try:
            return self._gpu_ms(mark, copy)
        except Exception as exc:  # noqa: BLE001 - any medium's error: the copy itself landed
            log.debug("a piece's GPU time was left out: %s", exc)
            return None

    def _check_time(self, until: float) -> None:
        late = self.clock() - until
        if late >= 0:
            raise CopyExpired(f"the copy is {late * 1e3:.0f} ms past when the leader may reuse its slots; stopped")

    def _pool(self) -> HostPool:
        assert self.host is not None, "a plan names G2 on a worker without G2"
        return self.host

    @staticmethod
    def _verify(sums: SlotSums, tier: Tier, slots: Slots, rows: Rows, picks: Ids) -> npt.NDArray[np.uint64]:
        bad, computed = sums.verify(slots, rows, picks)
        if bad.size:
            raise SlotsFailed(tier, bad.tolist(), "checksum mismatch")
        return computed

    # ------------------------------------------------------------------ engine <-> G2
    def _engine_host(self, kind: PlanKind, region: EngineRegion, blocks: EngineBlocks, slots: Slots,
                     until: float, grouping: Grouping | None = None, staged: StageLayout | None = None) -> None:
        """Piece k+1 is issued while piece k is in flight; the time is checked before each. A piece
        is a chunk of blocks, or with ``grouping`` one group's pages of a chunk (as :attr:`pacing` says);
        a group in ``staged`` is one piece, every block's pages from the staging area."""
        host, sums = self._pool(), self.host_sums
        per = HOST_CHUNK_BYTES // region.block_bytes
        pieces: Sequence[tuple[int, int, tuple[int, int] | None, bool]]  # (see grouping.Piece)
        depth = 1  # pieces in flight behind the one just issued
        if grouping is None:
            pieces = [(lo, hi, None, False) for lo, hi in chunks(len(blocks), per)]
        else:
            if sums is not None:  # every source is checked before the first group lands
                for lo, hi in chunks(len(blocks), per):
                    self._verify(sums, Tier.HOST, Slots(slots[lo:hi]), host.slots, Slots(slots[lo:hi]))
            pieces = group_pieces(len(blocks), grouping.bounds, region.page_bytes, self.pacing.piece_bytes)
            if staged is not None:
                assert list(staged.bounds) == grouping.bounds and staged.blocks == len(blocks), "a stage of another load"
                pieces = [(0, len(blocks), staged.pages(g), True) for g in range(staged.staged)] + \
                    [piece for piece in pieces if piece[2] is not None and staged.group_of(piece[2]) is None]
            depth = self.pacing.ahead or len(pieces)
        issued: list[Pending] = []
        in_flight: deque[tuple[Pending, Slots, tuple[int, int] | None, bool, float, float, int, ThreadUsage]] = deque()
        times = grouping.pieces if grouping is not None else None
        mark = self._gpu_mark() if times is not None else None
        queued = 0  # bytes of the layer-grouped pieces in flight
        words = SignalWriter(grouping.signals if grouping is not None else None,
                             lambda slot, value: self._signal(region, slot, value))
        turn = self.loads_first.store() if kind is PlanKind.STORE else None

        def settle(copy: Pending, to: Slots, pages: tuple[int, int] | None, group_done: bool, began: float,
                   sent: float, nbytes: int, used: ThreadUsage) -> None:
            nonlocal queued
            copy.wait()
            queued -= nbytes
            if times is not None:
                landed = time.perf_counter()
                times.append(PieceTimes(began, sent, landed, self._timed(mark, copy), used))
            if sums is not None and kind is PlanKind.STORE:
                sums.seal(to, host.slots, to)
            if group_done and grouping is not None and pages is not None:
                grouping.landed(pages[1])

        try:
            for lo, hi, pages, last in pieces:
                nbytes = 0 if pages is None else (hi - lo) * (pages[1] - pages[0]) * region.page_bytes
                queued += nbytes  # (layer-grouped pieces only)
                if turn is not None:
                    turn.before_piece(until, (hi - lo) * region.block_bytes)
                self._check_time(until - queued / DMA_FLOOR_BPS)
                began, usage = time.perf_counter(), ThreadUsage.now()
                b, s = EngineBlocks(blocks[lo:hi]), Slots(slots[lo:hi])
                if kind is PlanKind.STORE:
                    if sums is not None:
                        sums.forget(s)
                    issued.append(self._to_slots(region, b, host.slots, s))
                else:
                    if sums is not None and grouping is None:
                        self._verify(sums, Tier.HOST, s, host.slots, s)
                    if staged is not None and pages is not None and (g := staged.group_of(pages)) is not None:
                        issued.append(self._from_stage(region, b, staged, g, mark is not None))
                    else:
                        issued.append(self._from_slots(region, b, host.slots, s, pages, mark is not None))
                in_flight.append((issued[-1], s, pages, last, began, time.perf_counter(), nbytes,
                                  ThreadUsage.now().since(usage)))
                issued.extend(words.group_issued(pages[1]) if last and pages is not None else words.catch_up())
                # settle what landed (a synchronous medium's piece at once); keep at most ``depth`` queued
                while in_flight and (len(in_flight) > depth or in_flight[0][0].landed()):
                    settle(*in_flight.popleft())
            while in_flight:
                settle(*in_flight.popleft())
                issued.extend(words.catch_up())
        finally:
            for copy in issued:  # nothing may still be copying once the job is answered
                copy.wait()
            if turn is not None:
                turn.log(len(blocks))
        if kind is PlanKind.LOAD:
            self._check_time(until)  # the source slots were still ours while they were read

    def close(self) -> None:
        for buf in self.bounce.values():
            buf.close()
        self.bounce.clear()
