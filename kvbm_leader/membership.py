"""The node's workers: who is attached, their engine layouts, and the pool plan.

Runs in the leader; pure and synchronous. Pools are sized as Dynamo does: one logical
block is every worker's shard of it, so ``bytes per block = sum over workers of
num_layers * page_bytes`` and ``slots = GB * 1e9 // bytes per block`` (or the override).
Every (re)plan bumps ``epoch``; workers refuse plans of another epoch.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbm_client.config import KvbmConfig
from kvbm_client.ids import WorkerId
from kvbm_client.sizing import slot_bytes, tier_slots


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
class PoolPlan:
    epoch: int
    host_slots: int
    disk_slots: int


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
            return "failed"
        if self.layout is None:
            return "waiting-for-engine"
        return "ready" if self.ready_epoch == epoch else "allocating"


class Membership:
    """Attached workers and the current :class:`PoolPlan`."""

    def __init__(self, config: KvbmConfig, expected: list[WorkerId]) -> None:
        self.config = config
        self.expected = list(expected)
        self.workers: dict[WorkerId, WorkerRecord] = {}
        self.plan: PoolPlan | None = None
        self.epoch = 0

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
        """Every expected worker has allocated the current plan's pools."""
        return (self.plan is not None and self.all_attached and bool(self.members)
                and all(self.workers[w].ready_epoch == self.plan.epoch for w in self.members))

    def attach(self, record: WorkerRecord) -> None:
        if record.worker_id in self.workers:
            raise KeyError(f"worker {record.worker_id} is already attached")
        if self.expected and record.worker_id not in self.expected:
            raise LookupError(f"unknown worker {record.worker_id!r}; this leader expects "
                              f"{', '.join(self.expected)}")
        self.workers[record.worker_id] = record

    def detach(self, worker_id: WorkerId) -> WorkerRecord | None:
        """Forget a worker; its pools are gone, so the plan must be redone when it returns."""
        record = self.workers.pop(worker_id, None)
        if record is not None and self.plan is not None:
            self.plan = None
        return record

    def set_layout(self, worker_id: WorkerId, layout: Layout) -> bool:
        """Record a worker's engine layout; True when the pools must be (re)planned."""
        record = self.workers[worker_id]
        changed = record.layout != layout
        record.layout = layout
        return changed or self.plan is None

    def block_bytes(self) -> int:
        """Bytes one logical block takes in the pools: every worker's slot, alignment included."""
        return sum(slot_bytes(self.workers[w].layout.block_bytes) for w in self.members)  # type: ignore[union-attr]

    def replan(self) -> PoolPlan | None:
        """A new plan once every expected worker has a layout, else None."""
        if not self.all_attached or not self.members or any(
                self.workers[w].layout is None for w in self.members):
            return None
        total = self.block_bytes()
        cfg = self.config
        self.epoch += 1
        self.plan = PoolPlan(self.epoch,
                             tier_slots(cfg.cpu_cache_override_num_blocks, cfg.cpu_cache_gb, total),
                             tier_slots(cfg.disk_cache_override_num_blocks, cfg.disk_cache_gb, total))
        for record in self.workers.values():
            record.alloc_progress = 0.0
        return self.plan
