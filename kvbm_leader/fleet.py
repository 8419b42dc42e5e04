"""The worker fleet: attaching workers, their layouts, pool (re)plans and lost workers.

Runs in the leader, on its event loop. Decides the worker RPCs ``Attach``, ``SetLayout`` and
``PoolsReady`` (the access policy let only the node's daemons call them), and which workers a
lookup's stage goes to (``PrepareLoadRequest.stage``: sent on their streams, decided by them).
Owns the one reset both a lost worker and a re-plan go through (:meth:`WorkerFleet.reset`): every job fails
(counted in ``kvbm_failed_jobs``), every block is forgotten (``kvbm_lost_blocks``), routers
are told (``cleared``). With ``DYN_KVBM_DISK_PERSIST`` a reset leaves the persistent G3
index as it is, and once every worker's pools are ready the restorer rebuilds G3 from it
(:mod:`.restore`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Callable, Sequence

from kvbm_client.config import KvbmConfig
from kvbm_client.contract import MAX_LAYER_GROUPS, pb
from kvbm_client.ids import Tier, WorkerId

from .decisions import JobPlacement
from .events import KvEventFeed
from .ledger import JobLedger
from .membership import Layout, Membership, WorkerRecord
from .metrics import LeaderMetrics
from .placement import PlacementPolicy, store_demotion_limit
from .rebalancer import Rebalancer
from .refusals import Refused, Why
from .restore import G3Restorer
from .streams import WorkerStreams

log = logging.getLogger("kvbm.leader")
#: the most workers one lookup's stage names (one per tensor-parallel rank of an engine)
MAX_STAGE_TARGETS = 64


class WorkerFleet:
    """See the module docstring."""

    def __init__(self, config: KvbmConfig, leader_id: str, membership: Membership, placement: PlacementPolicy,
                 ledger: JobLedger, rebalancer: Rebalancer, feed: KvEventFeed, metrics: LeaderMetrics,
                 restorer: G3Restorer | None = None) -> None:
        self.config = config
        self.leader_id = leader_id
        self.membership = membership
        self.placement = placement
        self.ledger = ledger
        self.rebalancer = rebalancer
        self.feed = feed
        self.metrics = metrics
        self.restorer = restorer
        self.streams = WorkerStreams()
        self.all_attached = asyncio.Event()
        self.closing = False

    # ------------------------------------------------------------------ names
    def check_name(self, what: str, value: str) -> None:
        limit = self.config.max_name_bytes
        if len(value.encode()) > limit:
            raise Refused(Why.INVALID, f"{what} of {len(value.encode())} bytes; at most {limit} "
                                       "(DYN_KVBM_MAX_NAME_BYTES)")

    def record(self, worker_id: str) -> WorkerRecord:
        """The attached worker ``worker_id``, or :class:`Refused`."""
        self.check_name("worker_id", worker_id)
        record = self.membership.workers.get(WorkerId(worker_id))
        if record is None:
            raise Refused(Why.UNKNOWN, f"unknown worker {worker_id!r} (not attached)")
        return record

    # ------------------------------------------------------------------ attach
    def attach(self, record: WorkerRecord) -> None:
        """Admit a worker (its stream is served by :meth:`serve`), or :class:`Refused`."""
        self.check_name("worker_id", record.worker_id)
        self.check_name("endpoint", record.endpoint)
        try:
            self.membership.attach(record)
        except KeyError as exc:
            raise Refused(Why.DUPLICATE, str(exc.args[0])) from None
        except LookupError as exc:
            raise Refused(Why.UNKNOWN, str(exc)) from None
        log.info("worker %s attached (rank %d, pid %d, %s)", record.worker_id, record.rank, record.pid,
                 record.endpoint)
        if self.membership.all_attached:
            self.all_attached.set()

    async def serve(self, record: WorkerRecord) -> AsyncIterator["pb.LeaderEvent"]:
        """The attached worker's event stream; its end means the worker is gone."""
        welcome = pb.Welcome(leader_id=self.leader_id, job_timeout_s=self.config.job_timeout_secs)
        try:
            async for event in self.streams.serve(record.worker_id, welcome):
                yield event
        finally:
            if self.membership.workers.get(record.worker_id) is record:
                self.lost(record.worker_id, "attach stream ended")

    def lost(self, worker_id: WorkerId, why: str) -> None:
        self.membership.detach(worker_id)
        self.all_attached.clear()
        self.rebalancer.forget(worker_id)
        jobs, lost = self.reset()
        if not self.closing:  # a worker stopping while it holds nothing is routine, not a warning
            log.log(logging.WARNING if lost else logging.INFO,
                    "worker %s detached (%s): %d blocks are no longer matchable, %d jobs failed",
                    worker_id, why, lost, jobs)

    def reset(self) -> tuple[int, int]:
        """Every job fails and every block is forgotten (pools lost or re-planned); returns
        (jobs, blocks)."""
        jobs = self.ledger.fail_all()
        lost = self.placement.reset()
        self.metrics.inc("kvbm_lost_blocks", lost)
        self.feed.cleared()
        return jobs, lost

    # ------------------------------------------------------------------ layout and pools
    def set_layout(self, worker_id: str, layout: Layout) -> None:
        """Record a worker's engine layout and (re)plan the pools, or :class:`Refused` with
        the numbers (nothing changes then)."""
        record = self.record(worker_id)
        problem = self.membership.layout_problem(record.worker_id, layout)
        if problem is not None:
            log.error("layout of worker %s refused: %s", record.worker_id, problem)
            raise Refused(Why.INVALID, f"layout refused: {problem}")
        if self.membership.set_layout(record.worker_id, layout):
            self._replan()
            return
        log.info("worker %s re-registered the same layout; keeping %d blocks", record.worker_id,
                 len(self.placement.registry.parents))
        if self.membership.pools is not None:
            self.streams.send_pools(self.membership.pools, record.worker_id)

    def _replan(self) -> None:
        _, dropped = self.reset()
        sizes = self.membership.replan()
        if sizes is None:
            log.info("waiting for the layouts of %s", ", ".join(self.membership.waiting_for_layouts))
            return
        self.placement.resize({Tier.HOST: sizes.host_slots, Tier.DISK: sizes.disk_slots})
        self.placement.store_demotion_limit = store_demotion_limit(self.config.store_demotion_mb,
                                                                   self.membership.block_bytes())
        log.info("pool plan epoch %d: G2 %d blocks, G3 %d blocks (%d bytes per block over %d workers)%s",
                 sizes.epoch, sizes.host_slots, sizes.disk_slots, self.membership.block_bytes(),
                 len(self.membership.members), f"; dropped {dropped} blocks" if dropped else "")
        self.streams.send_pools(sizes)

    def pools_ready(self, worker_id: str, epoch: int, ok: bool, error: str, disk_index: str = "") -> None:
        record = self.record(worker_id)
        pools = self.membership.pools
        if pools is None or epoch != pools.epoch:
            return  # stale: newer pool sizes are on their way
        if not ok:
            record.error = error[:4096]
            log.error("worker %s could not allocate its pools: %s", record.worker_id, record.error)
            return
        record.ready_epoch, record.alloc_progress, record.error = pools.epoch, 1.0, ""
        if self.restorer is not None:
            self.restorer.pools_ready(record.worker_id, disk_index)
        log.info("worker %s pools ready (epoch %d)%s", record.worker_id, pools.epoch,
                 "; node ready" if self.membership.ready else
                 "; restoring G3" if self.membership.restoring is not None else "")

    # ------------------------------------------------------------------ stages (PrepareLoad.stage)
    def stage_sender(self, stage: "pb.LoadStage") -> Callable[[JobPlacement, "pb.SignedPlan"], None]:
        """What sends a lookup's plan as its ``stage`` asks, once signed (:meth:`send_stage`), or
        :class:`Refused` (INVALID) for a stage out of bounds (see :meth:`stage_targets`)."""
        targets = self.stage_targets(stage)
        groups = stage.layer_groups

        def send(plan: JobPlacement, signed: "pb.SignedPlan") -> None:
            self.send_stage(plan.job_id, signed, plan.tiers, groups, targets)
        return send

    def stage_targets(self, stage: "pb.LoadStage") -> list[tuple[WorkerId, str]]:
        """The (worker, region) pairs of a lookup's stage, or :class:`Refused` (INVALID) for one
        out of bounds: ``layer_groups`` in 2..MAX_LAYER_GROUPS, 1..MAX_STAGE_TARGETS targets,
        each worker once, names within ``DYN_KVBM_MAX_NAME_BYTES``."""
        if not 2 <= stage.layer_groups <= MAX_LAYER_GROUPS:
            raise Refused(Why.INVALID, f"stage.layer_groups={stage.layer_groups}; a stage takes 2 to "
                                       f"{MAX_LAYER_GROUPS}")
        if not 1 <= len(stage.targets) <= MAX_STAGE_TARGETS:
            raise Refused(Why.INVALID, f"stage of {len(stage.targets)} targets; 1 to {MAX_STAGE_TARGETS}")
        targets: list[tuple[WorkerId, str]] = []
        for target in stage.targets:
            self.check_name("stage target worker_id", target.worker_id)
            self.check_name("stage target region_id", target.region_id)
            if not target.region_id:
                raise Refused(Why.INVALID, f"stage target {target.worker_id!r} names no region")
            if any(w == target.worker_id for w, _ in targets):
                raise Refused(Why.INVALID, f"stage names worker {target.worker_id!r} twice")
            targets.append((WorkerId(target.worker_id), target.region_id))
        return targets

    def send_stage(self, job_id: int, signed: "pb.SignedPlan", tiers: Sequence[Tier], layer_groups: int,
                   targets: Sequence[tuple[WorkerId, str]]) -> int:
        """Send a just-planned load's stage to each target worker's stream (a worker not
        attached is skipped; a plan with G3 entries is not staged: workers stage G2 blocks
        only); returns how many were sent. The worker checks and decides it (:mod:`kvbm_worker.stages`)."""
        if Tier.DISK in tiers:
            log.debug("job %d load: not staged, it reads G3", job_id)
            return 0
        sent = []
        for worker_id, region_id in targets:
            request = pb.TransferRequest(region_id=region_id, plan=signed, layer_groups=layer_groups, stage=True,
                                         sent_at=time.time())
            if self.streams.send(worker_id, pb.LeaderEvent(stage=request)):
                sent.append(worker_id)
        log.debug("job %d load: stage of %d layer groups sent to worker(s) %s%s", job_id, layer_groups,
                  ",".join(sent) or "-", "" if len(sent) == len(targets) else
                  f" (not attached: {','.join(w for w, _ in targets if w not in sent)})")
        return len(sent)

    async def wait_attached(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.all_attached.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
