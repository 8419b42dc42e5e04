"""The copy executor on CPU, with real pools, a real G3 file and a real shared-memory engine
region (no daemons): bytes, checksums, short reads, time limits."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from kvbm_client import ShmKvBuffer
from kvbm_client.ids import JobId, PlanKind, Tier
from kvbm_worker import mover as mover_module
from kvbm_worker.errors import CopyExpired, SlotsFailed
from kvbm_worker.handlers.disk import PosixDiskIO
from kvbm_worker.handlers.disk_guard import TimedDiskIO
from kvbm_worker.jobs import JobKey
from kvbm_worker.grouping import DMA_FLOOR_BPS, RAMP, GroupPacing, Grouping, group_bounds, group_pieces
from kvbm_worker.mover import BlockMover
from kvbm_worker.plan_check import Batch
from kvbm_worker.pools import DiskPool, HostPool, SlotGeometry
from kvbm_worker.regions import EngineRegion, Peer
from kvbm_worker.stages import StageLayout

LAYERS, PAGE, BLOCKS = 3, 1000, 32  # 3000-byte blocks in 4096-byte slots
FAR = 1e18  # a time limit that never passes


class Rig:
    """An engine region, G2 (8 slots), G3 (16 slots) and a mover over them."""

    def __init__(self, root: Path, host_checksums: bool = False, clock=None) -> None:
        self.engine = ShmKvBuffer(BLOCKS, LAYERS, PAGE, directory=str(root))
        self.engine.array[:] = np.random.default_rng(0).integers(0, 256, self.engine.array.shape, dtype=np.uint8)
        spec = self.engine.spec()
        self.region = EngineRegion(spec.to_request(), spec.fds, Peer(os.getpid(), os.getuid(), os.getgid()))
        geo = lambda n: SlotGeometry.of(LAYERS * PAGE, n)  # noqa: E731
        self.host = HostPool(geo(8))
        self.disk = DiskPool(geo(16), str(root / "disk"), o_direct=True, zerofill_fallback=False)
        self.io = TimedDiskIO(PosixDiskIO(self.disk.fd), timeout=5.0)
        kwargs = {"clock": clock} if clock else {}
        self.mover = BlockMover(self.host, self.disk, self.io, host_checksums=host_checksums, bounce_slots=4, **kwargs)

    def run(self, kind, tier=Tier.DISK, slots=(), blocks=(), until=FAR, **moves) -> int:
        ids = lambda v: np.asarray(v, np.int64)  # noqa: E731
        batch = Batch(kind, JobKey("L", 1, JobId(1)), FAR, ids([tier] * len(slots)), ids(slots), ids(blocks),
                      **{k: ids(v) for k, v in moves.items()})
        return self.mover.run(batch, None if kind in (PlanKind.DEMOTE, PlanKind.PROMOTE) else self.region, until)

    def page(self, block: int) -> np.ndarray:
        return self.engine.array[block].copy()

    def poke_file(self, slot: int, offset: int = 17, data: bytes = b"\xff\x00\xff") -> None:
        fd = os.open(self.disk.path, os.O_RDWR)
        try:
            os.pwrite(fd, data, slot * self.disk.geometry.slot_bytes + offset)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.mover.close()
        self.io.close()
        self.disk.close()
        self.host.close()
        self.region.close()
        self.engine.close()


@pytest.fixture
def rig(tmp_path):
    made = []

    def make(**kw) -> Rig:
        made.append(Rig(tmp_path, **kw))
        return made[-1]
    yield make
    for r in made:
        r.close()


def test_g3_roundtrip_through_the_bounce_pipeline(rig):
    r = rig()
    src, dst, slots = list(range(0, 7)), list(range(20, 27)), [9, 2, 3, 4, 0, 15, 8]  # 4 chunks of 2 rows
    want = r.engine.array[src].copy()
    assert r.run(PlanKind.STORE, slots=slots, blocks=src) == 7 * LAYERS * PAGE
    r.engine.array[20:27] = 0
    r.run(PlanKind.LOAD, slots=slots, blocks=dst)
    assert np.array_equal(r.engine.array[dst], want)


def test_overwritten_g3_bytes_fail_the_load_and_never_reach_the_engine(rig):
    r = rig()
    r.run(PlanKind.STORE, slots=[5, 6], blocks=[1, 2])
    r.poke_file(6)
    before = r.engine.array.copy()
    with pytest.raises(SlotsFailed) as info:
        r.run(PlanKind.LOAD, slots=[5, 6], blocks=[10, 11])
    assert info.value.tier is Tier.DISK and info.value.slots == [6] and "checksum" in info.value.reason
    assert np.array_equal(r.engine.array, before), "unverified bytes reached the engine"
    r.run(PlanKind.LOAD, slots=[5], blocks=[10])  # the good slot still loads
    assert np.array_equal(r.engine.array[10], before[1])


def test_padding_past_the_block_bytes_is_not_checked(rig):
    r = rig()
    r.run(PlanKind.STORE, slots=[3], blocks=[4])
    r.poke_file(3, offset=LAYERS * PAGE + 10)  # the slot's alignment padding, never delivered
    r.run(PlanKind.LOAD, slots=[3], blocks=[30])
    assert np.array_equal(r.engine.array[30], r.engine.array[4])


def test_a_short_read_names_the_slots_it_could_not_read(rig):
    r = rig()
    r.run(PlanKind.STORE, slots=[0, 12], blocks=[1, 2])
    os.truncate(r.disk.path, 4 * r.disk.geometry.slot_bytes)
    with pytest.raises(SlotsFailed) as info:
        r.run(PlanKind.LOAD, slots=[12], blocks=[20])
    assert info.value.slots == [12] and "could not be read" in info.value.reason
    r.run(PlanKind.LOAD, slots=[0], blocks=[20])


def test_never_written_slots_do_not_verify(rig):
    r = rig()
    with pytest.raises(SlotsFailed):
        r.run(PlanKind.LOAD, slots=[7], blocks=[3])
    r.run(PlanKind.STORE, slots=[7], blocks=[3])
    r.mover.renew()  # a new pool epoch: contents void
    with pytest.raises(SlotsFailed):
        r.run(PlanKind.LOAD, slots=[7], blocks=[3])


def test_demotion_then_promotion_carries_verified_bytes(rig):
    r = rig(host_checksums=True)
    r.run(PlanKind.STORE, tier=Tier.HOST, slots=[0, 1], blocks=[5, 6])
    r.run(PlanKind.DEMOTE, demote_host=[0, 1], demote_disk=[10, 11])
    r.host.slots[:] = 0
    r.run(PlanKind.PROMOTE, promote_host=[4, 5], promote_disk=[10, 11])
    r.run(PlanKind.LOAD, tier=Tier.HOST, slots=[4, 5], blocks=[20, 21])
    assert np.array_equal(r.engine.array[20:22], r.engine.array[5:7])
    r.poke_file(11)
    host_before = r.host.slots.copy()
    with pytest.raises(SlotsFailed) as info:
        r.run(PlanKind.PROMOTE, promote_host=[6], promote_disk=[11])
    assert info.value.slots == [11]
    assert np.array_equal(r.host.slots, host_before), "a corrupt G3 block reached G2"


def test_host_checksums_catch_a_corrupted_g2_slot(rig):
    r = rig(host_checksums=True)
    r.run(PlanKind.STORE, tier=Tier.HOST, slots=[3], blocks=[8])
    r.host.slots[3, 100] ^= 0xFF
    before = r.engine.array.copy()
    with pytest.raises(SlotsFailed) as info:
        r.run(PlanKind.LOAD, tier=Tier.HOST, slots=[3], blocks=[9])
    assert info.value.tier is Tier.HOST and info.value.slots == [3]
    assert np.array_equal(r.engine.array, before)
    with pytest.raises(SlotsFailed):  # nor is it demoted to G3
        r.run(PlanKind.DEMOTE, demote_host=[3], demote_disk=[0])


def test_a_copy_stops_where_the_leader_may_reuse_its_slots(rig, monkeypatch):
    monkeypatch.setattr(mover_module, "HOST_CHUNK_BYTES", 2 * LAYERS * PAGE)  # two blocks per chunk
    ticks = iter(range(1, 100))
    r = rig(clock=lambda: float(next(ticks)))  # one second passes at every time check
    r.host.slots[:] = 0xA5
    with pytest.raises(CopyExpired):
        r.run(PlanKind.STORE, tier=Tier.HOST, slots=[0, 1, 2, 3], blocks=[0, 1, 2, 3], until=1.5)
    assert np.array_equal(r.host.slots[0, :LAYERS * PAGE], r.engine.array[0].ravel())  # the first chunk
    assert (r.host.slots[2:4] == 0xA5).all(), "a chunk was written after the time limit"
    ticks = iter(range(1, 100))
    with pytest.raises(CopyExpired):  # sources read past the limit: the load is not reported done
        r.run(PlanKind.LOAD, tier=Tier.HOST, slots=[0], blocks=[20], until=1.5)


def test_an_engine_block_outside_the_region_is_refused_before_copying(rig):
    r = rig()
    with pytest.raises(ValueError, match="outside"):
        r.run(PlanKind.LOAD, tier=Tier.HOST, slots=[0], blocks=[-1])


def test_a_layer_grouped_load_lands_group_by_group_and_times_every_piece(rig):
    r = rig()
    r.mover.pacing = GroupPacing(piece_bytes=2 * PAGE)  # two blocks' pages of a group per piece
    r.run(PlanKind.STORE, Tier.HOST, slots=[0, 1, 2, 3], blocks=[4, 5, 6, 7])
    before = [r.page(b) for b in (4, 5, 6, 7)]
    r.engine.array[[10, 11, 12, 13]] = 0
    landed: list[int] = []
    pieces: list[mover_module.PieceTimes] = []
    ids = lambda v: np.asarray(v, np.int64)  # noqa: E731
    batch = Batch(PlanKind.LOAD, JobKey("L", 1, JobId(2)), FAR, ids([Tier.HOST] * 4), ids([0, 1, 2, 3]),
                  ids([10, 11, 12, 13]))
    r.mover.run(batch, r.region, FAR, mover_module.Grouping([1, 3], landed.append, pieces))
    assert landed == [1, 3], "each group's end page, in order"
    assert [r.page(b).tobytes() for b in (10, 11, 12, 13)] == [p.tobytes() for p in before]
    assert len(pieces) == len(group_pieces(4, [1, 3], PAGE, 2 * PAGE))
    assert all(p.began <= p.issued <= p.landed and p.gpu_ms is None for p in pieces)


class ClockFails(BlockMover):
    """The CPU medium whose GPU clock has a mark but cannot time a copy (as CUDA answered
    ``cudaErrorNotReady`` for a mark queued behind a stage's copies)."""

    def _gpu_mark(self):
        return object()

    def _gpu_ms(self, mark, copy):
        raise RuntimeError("cudaEventElapsedTime: cudaErrorNotReady")


def test_a_piece_that_cannot_be_timed_is_logged_without_its_time_and_the_load_lands(rig):
    r = rig()
    r.run(PlanKind.STORE, Tier.HOST, slots=[0, 1, 2, 3], blocks=[4, 5, 6, 7])
    before = [r.page(b).tobytes() for b in (4, 5, 6, 7)]
    mover = ClockFails(r.host, None, None)
    landed: list[int] = []
    pieces: list[mover_module.PieceTimes] = []
    ids = lambda v: np.asarray(v, np.int64)  # noqa: E731
    batch = Batch(PlanKind.LOAD, JobKey("L", 1, JobId(2)), FAR, ids([Tier.HOST] * 4), ids([0, 1, 2, 3]),
                  ids([10, 11, 12, 13]))
    try:
        mover.run(batch, r.region, FAR, mover_module.Grouping([1, 3], landed.append, pieces))
    finally:
        mover.close()
    assert landed == [1, 3] and pieces and all(p.gpu_ms is None for p in pieces)
    assert [r.page(b).tobytes() for b in (10, 11, 12, 13)] == before


def test_a_staged_load_takes_its_staged_groups_from_the_area_and_the_rest_from_the_slots(rig):
    """Staged groups are the bytes read at the stage (the slots are overwritten after it here, to
    tell the two sources apart), the other groups those of the slots when the blocks are known."""
    r = rig()
    r.mover.stage_bytes = 4 * PAGE  # the first group (page 0) of 4 blocks; not the second (pages 1, 2)
    r.run(PlanKind.STORE, Tier.HOST, slots=[0, 1, 2, 3], blocks=[4, 5, 6, 7])
    staged_then = r.engine.array[[4, 5, 6, 7]].copy()
    ids = lambda v: np.asarray(v, np.int64)  # noqa: E731
    batch = Batch(PlanKind.LOAD, JobKey("L", 1, JobId(3)), FAR, ids([Tier.HOST] * 4), ids([0, 1, 2, 3]))
    layout = StageLayout.fit(4, [1, 3], PAGE, r.mover.stage_bytes)
    assert layout is not None and layout.staged == 1 and layout.nbytes == 4 * PAGE
    r.mover.stage(batch, r.region, FAR, layout)
    r.host.slots[[0, 1, 2, 3]] = 9  # (not what a job's pinned slots ever see: only to tell the sources apart)
    r.engine.array[[10, 11, 12, 13]] = 0
    landed: list[int] = []
    load = Batch(PlanKind.LOAD, JobKey("L", 1, JobId(3)), FAR, ids([Tier.HOST] * 4), ids([0, 1, 2, 3]),
                 ids([13, 10, 12, 11]))
    r.mover.run(load, r.region, FAR, mover_module.Grouping([1, 3], landed.append), layout)
    assert landed == [1, 3]
    got = r.engine.array[[13, 10, 12, 11]]
    assert np.array_equal(got[:, 0], staged_then[:, 0]), "group 0 (layer 0) from the area"
    assert (got[:, 1:] == 9).all(), "group 1 (layers 1, 2) from the slots"


# ---------------------------------------------------------------------- layer groups: cutting and pacing
class Deferred(BlockMover):
    """The CPU medium with an asynchronous face: a load's copy happens at issue, but it counts as
    landed only when waited for; ``log`` records the order of issues and waits."""

    def __init__(self, *args, landed_after: int | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.log: list[str] = []
        self.landed_after = landed_after  # a piece says it landed once this many later ones were issued

    def _from_slots(self, region, blocks, rows, picks, pages=None, timed=False):
        super()._from_slots(region, blocks, rows, picks, pages)
        n = sum(e == "issue" for e in self.log)
        self.log.append("issue")
        log, after = self.log, self.landed_after

        class Copy:
            def wait(self) -> None:
                log.append(f"wait {n}")

            def landed(self) -> bool:
                return after is not None and log.count("issue") > n + after
        return Copy()


def grouped_load(r: Rig, pacing: GroupPacing, until: float = FAR, clock=None, landed_after: int | None = None
                 ) -> tuple[Deferred, list[int]]:
    """A 4-block load from G2 in groups [1, 3] on a :class:`Deferred` mover with ``pacing``."""
    r.run(PlanKind.STORE, Tier.HOST, slots=[0, 1, 2, 3], blocks=[4, 5, 6, 7])
    mover = Deferred(r.host, None, None, pacing=pacing, landed_after=landed_after,
                     **({"clock": clock} if clock else {}))
    ids = lambda v: np.asarray(v, np.int64)  # noqa: E731
    batch = Batch(PlanKind.LOAD, JobKey("L", 1, JobId(3)), FAR, ids([Tier.HOST] * 4), ids([0, 1, 2, 3]),
                  ids([10, 11, 12, 13]))
    landed: list[int] = []
    try:
        mover.run(batch, r.region, until, Grouping([1, 3], landed.append))
    finally:
        mover.close()
    return mover, landed


def test_group_bounds_shrink_towards_the_last_layer_and_leave_no_group_empty():
    assert group_bounds(36, 6) == [11, 20, 27, 32, 35, 36], "11, 9, 7, 5, 3 and 1 pages"
    assert group_bounds(72, 6) == [22, 40, 54, 64, 70, 72]
    assert group_bounds(4, 3) == [2, 3, 4]
    assert group_bounds(4, 9) == [1, 2, 3, 4], "more groups than pages: a page each"
    assert group_bounds(8, 1) == [8]
    for pages in range(1, 80):
        for groups in range(1, 70):
            ends = group_bounds(pages, groups)
            sizes = [b - a for a, b in zip([0, *ends[:-1]], ends)]
            assert ends[-1] == pages and len(ends) == min(groups, pages) and min(sizes) >= 1


def test_group_pieces_keep_groups_outermost_and_ramp_up_to_their_size():
    # 4 blocks in groups of 1 and 2 pages of 1000 bytes, pieces up to 16000 bytes: the first
    # piece is 16000 >> RAMP = 2000 bytes (2 blocks of group 1), then 4000, then 8000 ...
    assert RAMP == 3
    assert group_pieces(4, [1, 3], 1000, 16000) == [(0, 2, (0, 1), False), (2, 4, (0, 1), True),
                                                    (0, 4, (1, 3), True)]
    # pieces of at most 2000 bytes (the ramp starts below one block: one block a piece)
    assert group_pieces(4, [1, 3], 1000, 2000) == [(b, b + 1, g, b == 3) for g in ((0, 1), (1, 3)) for b in range(4)]
    assert group_pieces(4, [1, 3], 1000, 1) == group_pieces(4, [1, 3], 1000, 2000), "never less than a block"
    full = group_pieces(1258, group_bounds(36, 6), 65536, 256 << 20)  # the H100 runs' 20K-token load
    sizes = [(hi - lo) * (g[1] - g[0]) * 65536 for lo, hi, g, _ in full]
    assert sizes[0] <= 32 << 20 < sizes[2] and max(sizes) <= 256 << 20
    assert [(lo, hi) for lo, hi, _, last in full if last] == [(lo, 1258) for lo, hi, _, last in full if last]
    with pytest.raises(ValueError):
        GroupPacing(piece_bytes=0)
    with pytest.raises(ValueError):
        GroupPacing(ahead=-1)


@pytest.mark.parametrize("ahead, first_wait_after", [(1, 2), (3, 4), (0, 8)])
def test_a_grouped_load_queues_as_many_pieces_ahead_as_its_pacing_says(rig, ahead, first_wait_after):
    r = rig()
    before = [r.page(b).tobytes() for b in (4, 5, 6, 7)]
    mover, landed = grouped_load(r, GroupPacing(piece_bytes=2 * PAGE, ahead=ahead))
    assert mover.log.index("wait 0") == first_wait_after, mover.log  # 8 pieces (see above); 0: all issued first
    assert mover.log.count("issue") == 8 and landed == [1, 3]
    assert [r.page(b).tobytes() for b in (10, 11, 12, 13)] == before


def test_a_piece_that_landed_is_settled_at_the_next_issue_not_when_the_queue_is_full(rig):
    """The lane reports a group as soon as it sees its last piece landed (a non-blocking check
    after each issue), not only once ``ahead`` more pieces were queued behind it."""
    mover, landed = grouped_load(rig(), GroupPacing(piece_bytes=2 * PAGE, ahead=3), landed_after=0)
    assert mover.log[:4] == ["issue", "wait 0", "issue", "wait 1"], mover.log
    assert landed == [1, 3] and mover.log.count("issue") == 8


def test_pieces_queued_ahead_must_land_before_the_deadline_at_the_floor_pace(rig):
    r = rig()
    piece = 2 * PAGE  # pieces of one block: 1000 bytes in group 1; with ahead 0 nothing settles in between
    until = 3 * PAGE / DMA_FLOOR_BPS  # the clock reads 0: room for two of them at the floor pace, not three
    with pytest.raises(CopyExpired):
        grouped_load(r, GroupPacing(piece_bytes=piece, ahead=0), until=until, clock=lambda: 0.0)
    mover, landed = grouped_load(r, GroupPacing(piece_bytes=piece, ahead=0), until=10 * until, clock=lambda: 0.0)
    assert landed == [1, 3], "the whole load (12000 bytes) fits in 10 x that room"


def test_the_mover_holds_a_g2_store_while_a_load_runs_and_marks_its_own_loads(rig):
    r = rig()
    r.mover.loads_first.budget_s = 5.0
    done = threading.Event()

    def store() -> None:
        r.run(PlanKind.STORE, tier=Tier.HOST, slots=[0, 1], blocks=[3, 4])
        done.set()
    with r.mover.loads_first.loading():  # a load runs on the other lane
        t = threading.Thread(target=store)
        t.start()
        assert not done.wait(0.2), "the store copied while a load ran"
    assert done.wait(5), "the store did not go once the load ended"
    t.join()
    seen: list[tuple[str, int]] = []
    engine_host, load_disk = r.mover._engine_host, r.mover._load_disk

    def spy(kind, *args, **kwargs):
        seen.append((kind.name, r.mover.loads_first.active))
        return engine_host(kind, *args, **kwargs)

    def spy_disk(*args, **kwargs):
        seen.append(("G3 load", r.mover.loads_first.active))
        return load_disk(*args, **kwargs)
    r.mover._engine_host = spy  # type: ignore[method-assign]
    r.mover._load_disk = spy_disk  # type: ignore[method-assign]
    r.engine.array[20:22] = 0
    r.run(PlanKind.LOAD, tier=Tier.HOST, slots=[0, 1], blocks=[20, 21])
    r.run(PlanKind.STORE, tier=Tier.HOST, slots=[2], blocks=[5])
    r.run(PlanKind.STORE, slots=[7], blocks=[6])
    r.run(PlanKind.LOAD, slots=[7], blocks=[25])
    assert seen == [("LOAD", 1), ("STORE", 0), ("G3 load", 0)], "only G2 loads make stores wait"
    assert np.array_equal(r.engine.array[25], r.engine.array[6])
    assert np.array_equal(r.engine.array[20:22], r.engine.array[3:5]) and r.engine.array[3].size == LAYERS * PAGE
    assert r.mover.loads_first.active == 0
