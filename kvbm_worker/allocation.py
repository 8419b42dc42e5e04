"""Pool allocation on the leader's pool plans: the G2 host pool, the G3 file, their I/O and
copy executor, for one pool epoch at a time.

Runs in the worker daemon: :meth:`PoolAllocator.apply` on the event loop, the allocation
itself on an executor thread (touching and pinning GBs takes seconds to minutes), reporting
through an explicit :class:`AllocationProgress` (shown by ``Status`` and logged every 10 %).

Invariants: the pools of an epoch are freed only after every copy that could use them
finished (``lanes.drain()``); a plan with the geometry already allocated keeps the memory
(its contents are void: the checksums are reset); a failed allocation leaves no pools.

With ``DYN_KVBM_DISK_PERSIST`` the G3 file is named after the worker and its engine layout
and reopened (:class:`~.pools.PersistAs`); a new epoch on the same pools keeps its contents,
and ``PoolsReady`` is answered only once no copy of an earlier epoch runs any more (the
leader restores G3 from the shard index after it, which no straggling copy may change).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

from kvbm_client.config import KvbmConfig
from kvbm_client.contract import pb
from kvbm_client.g3_files import shard_fingerprint
from kvbm_client.ids import Tier

from .grouping import GroupPacing
from .handlers.cuda_copier import CopyMechanism
from .handlers.disk import open_disk_io
from .handlers.disk_guard import TimedDiskIO
from .handlers.issuers import ISSUE_THREADS, SPLIT_MIN_COPIES
from .loads_first import STORE_YIELD_MS
from .lanes import Lanes
from .mover import BlockMover
from .pools import DiskPool, HostPool, PersistAs, SlotGeometry

log = logging.getLogger("kvbm.worker")


@dataclass(frozen=True, slots=True)
class DataPath:
    """How this worker reaches its engine's memory (``kvbm-worker --cpu`` / ``--gpu N``)."""

    gpu: int | None = None  # CUDA device: CUDA IPC regions, pinned G2, CUDA streams
    cuda_copy: CopyMechanism = CopyMechanism.AUTO
    prefer_nixl: bool = True  # G3 through NIXL's POSIX backend when it loads
    pacing: GroupPacing = GroupPacing()  # how layer-grouped loads are cut and queued
    issue_threads: int = ISSUE_THREADS  # threads issuing one load's long copy lists at once (GPU)
    issue_split_copies: int = SPLIT_MIN_COPIES  # the shortest copy list they split
    store_yield_ms: float = STORE_YIELD_MS  # a G2 store job's longest wait for loads, in all
    stage_bytes: int = 0  # the staging area of loads staged before their blocks exist (0: none)


@dataclass
class Pools:
    """One epoch's allocated tiers and the executor that copies between them."""

    epoch: int
    host: HostPool | None
    disk: DiskPool | None
    mover: BlockMover
    disk_io: TimedDiskIO | None = None

    @property
    def disk_backend(self) -> str:
        return self.disk_io.name if self.disk_io is not None else ""

    def slots(self, tier: Tier) -> int:
        pool = self.host if tier is Tier.HOST else self.disk if tier is Tier.DISK else None
        return pool.geometry.num_slots if pool is not None else 0

    @property
    def disk_index(self) -> str:
        """The G3 shard index's path ("" when G3 is not persistent)."""
        return self.disk.index_path if self.disk is not None else ""

    def fits(self, host: SlotGeometry, disk: SlotGeometry, persist: PersistAs | None) -> bool:
        return (_same(self.host, host) and _same(self.disk, disk)
                and (self.disk is None or self.disk.persist == persist))

    def close(self) -> None:
        self.mover.close()
        if self.disk_io is not None:
            self.disk_io.close()
        for pool in (self.disk, self.host):
            if pool is not None:
                pool.close()


def _same(pool: HostPool | DiskPool | None, geometry: SlotGeometry) -> bool:
    return geometry.num_slots == 0 if pool is None else pool.geometry == geometry


@dataclass
class AllocationProgress:
    """How far one allocation got (0..1), and its time limit (CLOCK_MONOTONIC).

    ``update`` is called from the allocating thread; it logs every 10 % and raises
    ``TimeoutError`` once past ``deadline`` (so a slow allocation stops)."""

    deadline: float
    pinning: bool = False  # a GPU worker: the second half is pinning G2 for CUDA
    fraction: float = 0.0
    _logged_step: int = field(default=-1, repr=False)

    def update(self, fraction: float) -> None:
        self.fraction = fraction
        step = int(fraction * 10)
        if step != self._logged_step:
            self._logged_step = step
            log.info("G2 allocation %.0f%%%s", fraction * 100, " (pinning for CUDA)" if self.pinning and
                     fraction > 0.5 else "")
        if time.monotonic() > self.deadline and fraction < 1.0:
            raise TimeoutError(f"G2 allocation at {fraction * 100:.0f}% after the init timeout "
                               "(DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS)")

    def first_half(self, fraction: float) -> None:
        self.update(fraction / 2 if self.pinning else fraction)

    def second_half(self, fraction: float) -> None:
        self.update(0.5 + fraction / 2)


class PoolAllocator:
    """Owns the current :class:`Pools` (``current``), the progress of their allocation, and the
    epoch the leader was told is ready (``announced``).

    The pools are *ready* (:attr:`ready`, ``Status``'s "ready") only once the leader accepted
    this worker's ``PoolsReady`` for their epoch: until then the leader plans no store onto them
    (it answers every ``PrepareStore`` with nothing), and the engine's connector, which waits for
    "ready" before the engine serves, would lose its first requests' stores. (The node can still
    be unready after that: other workers' pools, or a persistent G3 being restored.)
    """

    def __init__(self, config: KvbmConfig, worker_id: str, path: DataPath, lanes: Lanes) -> None:
        self.config, self.worker_id, self.path = config, worker_id, path
        self._lanes = lanes
        self._lock = asyncio.Lock()
        self.current: Pools | None = None
        self.progress: AllocationProgress | None = None
        self.error = ""  # why the last allocation failed ("" while none did)
        self.announced = -1  # the epoch of the current plan whose PoolsReady the leader accepted (-1: not yet)

    @property
    def ready(self) -> bool:
        """The current pools are allocated and the leader knows it (see the class docstring)."""
        return self.current is not None and self.current.epoch == self.announced

    def announce(self, epoch: int) -> None:
        """The leader accepted this worker's ``PoolsReady`` for ``epoch``."""
        self.announced = epoch

    def unannounce(self) -> None:
        """No leader has accepted the current pools (yet): a new plan is being applied, or a new
        leader welcomed this worker."""
        self.announced = -1

    async def apply(self, plan: "pb.PoolPlan", layout: "pb.KvLayout") -> tuple[bool, str]:
        """Make the pools match ``plan`` for ``layout``; returns (ok, error) for ``PoolsReady``."""
        async with self._lock:
            self.unannounce()  # a new plan (perhaps a new leader's, whose epochs restart): not announced yet
            block_bytes = layout.num_layers * layout.page_bytes
            host_geo = SlotGeometry.of(block_bytes, plan.host_slots)
            disk_geo = SlotGeometry.of(block_bytes, plan.disk_slots)
            persist = PersistAs(self.worker_id, shard_fingerprint(layout.num_layers, layout.page_bytes, layout.dtype),
                                self.config.disk_persist_sync) if self.config.disk_persist else None
            old = self.current
            if old is not None and old.fits(host_geo, disk_geo, persist):
                # same geometry: keep the memory; its contents are now void (G3 too, unless persistent)
                await self._lanes.drain()  # no copy of the old epoch (or leader) runs into the new one
                old.epoch = plan.epoch
                old.mover.renew()
                log.info("pools kept for epoch %d", plan.epoch)
                return True, ""
            self.current = None
            await self._lanes.drain()
            if old is not None:
                old.close()
            self.error = ""  # a new try: "allocating", not the last try's "failed"
            try:
                self.progress = AllocationProgress(
                    time.monotonic() + self.config.leader_worker_init_timeout_secs, pinning=self.path.gpu is not None)
                pools = await asyncio.get_running_loop().run_in_executor(
                    None, self._allocate, plan.epoch, host_geo, disk_geo, persist, self.progress)
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("pool allocation failed: %s", self.error)
                return False, self.error
            self.current, self.error = pools, ""
            try:
                await self._lanes.on_each(pools.mover.warm_lane)
            except Exception as exc:  # the jobs will report the same failure, one by one
                log.warning("lane warm-up failed (%s: %s); the first copies pay their first-use costs",
                            type(exc).__name__, exc)
            return True, ""

    def _allocate(self, epoch: int, host_geo: SlotGeometry, disk_geo: SlotGeometry, persist: PersistAs | None,
                  progress: AllocationProgress) -> Pools:
        cfg = self.config
        host = disk = None
        disk_io: TimedDiskIO | None = None
        try:
            if host_geo.num_slots:
                log.info("allocating G2: %d slots x %d bytes = %.2f GB", host_geo.num_slots, host_geo.slot_bytes,
                         host_geo.total_bytes / 1e9)
                host = HostPool(host_geo)
                host.commit(progress.first_half)
            if disk_geo.num_slots:
                disk = DiskPool(disk_geo, cfg.disk_cache_dir, o_direct=not cfg.disk_disable_o_direct,
                                zerofill_fallback=cfg.disk_zerofill_fallback, persist=persist)
                raw = open_disk_io(disk.fd, disk_geo.total_bytes, f"kvbm-worker-{self.worker_id}-{os.getpid()}",
                                   prefer_nixl=self.path.prefer_nixl)
                disk_io = TimedDiskIO(raw, cfg.disk_io_timeout_secs)
                log.info("G3: %s, %d slots (%.2f GB), I/O via %s, checksummed%s", disk.path, disk_geo.num_slots,
                         disk_geo.total_bytes / 1e9, disk_io.name, ", persistent" if persist else "")
            return Pools(epoch, host, disk, self._mover(host, disk, disk_io, progress), disk_io)
        except BaseException:
            if disk_io is not None:
                disk_io.close()
            for pool in (disk, host):
                if pool is not None:
                    pool.close()
            raise

    def _mover(self, host: HostPool | None, disk: DiskPool | None, disk_io: TimedDiskIO | None,
               progress: AllocationProgress) -> BlockMover:
        checksums = self.config.host_checksums
        if self.path.stage_bytes:
            log.info("staging area: %s MiB %s (--stage-mib; a layerwise load's first layer group is staged at "
                     "its lookup)", f"{self.path.stage_bytes / (1 << 20):g}",
                     "in host memory" if self.path.gpu is None else f"on cuda:{self.path.gpu}")
        if self.path.gpu is None:
            return BlockMover(host, disk, disk_io, host_checksums=checksums, pacing=self.path.pacing,
                              store_yield_ms=self.path.store_yield_ms, stage_bytes=self.path.stage_bytes)
        from .handlers.cuda import CudaMover  # lazy: CUDA only on a GPU worker
        return CudaMover(host, disk, disk_io, host_checksums=checksums, pacing=self.path.pacing,
                         store_yield_ms=self.path.store_yield_ms, device=self.path.gpu,
                         mechanism=self.path.cuda_copy, progress=progress.second_half, deadline=progress.deadline,
                         issue_threads=self.path.issue_threads, split_min=self.path.issue_split_copies,
                         stage_bytes=self.path.stage_bytes)

    @property
    def disk_index(self) -> str:
        """What ``PoolsReady`` tells the leader: the current G3 shard index ("" if none)."""
        return self.current.disk_index if self.current is not None else ""

    def close(self) -> None:
        """Free the pools (after the lanes drained); idempotent."""
        if self.current is not None:
            self.current.close()
            self.current = None

