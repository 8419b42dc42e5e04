"""The node's workers: who is attached, their engine layouts, and the pool sizes.

Runs in the leader; pure and synchronous. Pools are sized as Dynamo does: one logical
block is every worker's shard of it, so ``bytes per block = sum over workers of the slot
bytes of num_layers * page_bytes`` (:mod:`kvbm_client.sizing`, the rule the workers allocate
with) and ``slots = GB * 1e9 // bytes per block`` (or the override). Every (re)plan bumps
``epoch``; workers refuse plans of another epoch. A layout is validated before it is
recorded (:meth:`Membership.layout_problem`): a refused layout changes nothing.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kvbm_client.config import KvbmConfig
from kvbm_client.ids import WorkerId
from kvbm_client.sizing import MAX_ENGINE_BLOCKS, MAX_SHARD_BYTES, slot_bytes, tier_problem, tier_slots


@dataclass(frozen=True, slots=True)
class Layout:
    num_layers: int
    page_bytes: int
    dtype: str
    num_engine_blocks: int
    rank: int

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.page_bytes


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """How many slots each tier has in one pool epoch (the wire form is ``pb.PoolPlan``)."""

    epoch: int
    host_slots: int
    disk_slots: int


class WorkerState(enum.Enum):
    FAILED = "failed"
    WAITING_FOR_ENGINE = "waiting-for-engine"
    ALLOCATING = "allocating"
    READY = "ready"


@dataclass(slots=True)
class WorkerRecord:
    worker_id: WorkerId
    rank: int
    endpoint: str
    pid: int
    cuda: bool
    layout: Layout | None = None
    ready_epoch: int = -1
    alloc_progress: float = 0.0
    error: str = ""

    def state(self, epoch: int) -> str:
        if self.error:
            state = WorkerState.FAILED
        elif self.layout is None:
            state = WorkerState.WAITING_FOR_ENGINE
        else:
            state = WorkerState.READY if self.ready_epoch == epoch else WorkerState.ALLOCATING
        return str(state.value)


class Membership:
    """Attached workers and the current :class:`PoolSizes`."""

    def __init__(self, config: KvbmConfig, expected: list[WorkerId]) -> None:
        self.config = config
        self.expected = list(expected)
        self.workers: dict[WorkerId, WorkerRecord] = {}
        self.pools: PoolSizes | None = None
        self.epoch = 0
        #: the pool epoch whose G3 is being restored from the persistent index (not ready meanwhile)
        self.restoring: int | None = None

    @property
    def members(self) -> list[WorkerId]:
        """The workers pools are planned over: the expected ones, or (none expected) the attached."""
        return self.expected if self.expected else sorted(self.workers)

    @property
    def missing(self) -> list[WorkerId]:
        return [w for w in self.expected if w not in self.workers]

    @property
    def all_attached(self) -> bool:
        return not self.missing

    @property
    def ready(self) -> bool:
        """Every expected worker has allocated the current pools, and no G3 restore runs."""
        return self.pools_ready and self.restoring is None

    @property
    def pools_ready(self) -> bool:
        """Every expected worker has allocated the current pools."""
        pools = self.pools
        return (pools is not None and self.all_attached and bool(self.members)
                and all(self.workers[w].ready_epoch == pools.epoch for w in self.members))

    @property
    def waiting_for_layouts(self) -> list[WorkerId]:
        return [w for w in self.members if w not in self.workers or self.workers[w].layout is None]

    def attach(self, record: WorkerRecord) -> None:
        if record.worker_id in self.workers:
            raise KeyError(f"worker {record.worker_id} is already attached")
        if self.expected and record.worker_id not in self.expected:
            raise LookupError(f"unknown worker {record.worker_id!r}; this leader expects "
                              f"{', '.join(self.expected)}")
        self.workers[record.worker_id] = record

    def detach(self, worker_id: WorkerId) -> WorkerRecord | None:
        """Forget a worker; its pools are gone, so they must be re-planned when it returns."""
        record = self.workers.pop(worker_id, None)
        if record is not None and self.pools is not None:
            self.pools = None
        return record

    def layout_problem(self, worker_id: WorkerId, layout: Layout) -> str | None:
        """Why ``layout`` cannot be accepted from ``worker_id`` (bounds, or a configured tier
        that would get 0 blocks or more than its GB), or None. Changes nothing."""
        cfg = self.config
        if not 0 < layout.num_layers <= cfg.max_region_pages:
            return f"num_layers {layout.num_layers} outside 1..{cfg.max_region_pages} (DYN_KVBM_MAX_REGION_PAGES)"
        if not 0 < layout.page_bytes or layout.block_bytes > MAX_SHARD_BYTES:
            return (f"{layout.num_layers} layers x {layout.page_bytes} page bytes: a block shard must hold "
                    f"1..{MAX_SHARD_BYTES} bytes")
        if not 0 < layout.num_engine_blocks <= MAX_ENGINE_BLOCKS:
            return f"num_engine_blocks {layout.num_engine_blocks} outside 1..{MAX_ENGINE_BLOCKS}"
        if len(layout.dtype.encode()) > cfg.max_name_bytes:
            return f"dtype of {len(layout.dtype.encode())} bytes; at most {cfg.max_name_bytes}"
        total = sum(slot_bytes(lay.block_bytes) for w in self.members
                    if w != worker_id and (lay := self._layout(w)) is not None) + slot_bytes(layout.block_bytes)
        for problem in (tier_problem("G2", "DYN_KVBM_CPU_CACHE_GB", cfg.cpu_cache_override_num_blocks,
                                     cfg.cpu_cache_gb, total),
                        tier_problem("G3", "DYN_KVBM_DISK_CACHE_GB", cfg.disk_cache_override_num_blocks,
                                     cfg.disk_cache_gb, total)):
            if problem is not None:
                return f"{problem} ({layout.num_layers} layers x {layout.page_bytes} bytes from worker {worker_id})"
        return None

    def _layout(self, worker_id: WorkerId) -> Layout | None:
        record = self.workers.get(worker_id)
        return record.layout if record is not None else None

    def set_layout(self, worker_id: WorkerId, layout: Layout) -> bool:
        """Record a worker's engine layout; True when the pools must be (re)planned."""
        record = self.workers[worker_id]
        changed = record.layout != layout
        record.layout = layout
        return changed or self.pools is None

    def block_bytes(self) -> int:
        """Bytes one logical block takes in the pools: every worker's slot, alignment included."""
        return sum(slot_bytes(lay.block_bytes) for w in self.members if (lay := self._layout(w)) is not None)

    def shard_bytes(self) -> int:
        """Bytes of the largest worker's shard of one block (workers copy their shards in
        parallel, so the largest bounds a load's time); 0 before any layout."""
        return max((lay.block_bytes for w in self.members if (lay := self._layout(w)) is not None), default=0)

    def replan(self) -> PoolSizes | None:
        """New pool sizes once every expected worker has a layout, else None."""
        if not self.all_attached or not self.members or self.waiting_for_layouts:
            return None
        total = self.block_bytes()
        cfg = self.config
        self.epoch += 1
        self.pools = PoolSizes(self.epoch,
                               tier_slots(cfg.cpu_cache_override_num_blocks, cfg.cpu_cache_gb, total),
                               tier_slots(cfg.disk_cache_override_num_blocks, cfg.disk_cache_gb, total))
        for record in self.workers.values():
            record.alloc_progress = 0.0
        return self.pools
