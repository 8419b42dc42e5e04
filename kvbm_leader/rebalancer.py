"""The rebalancer: leader-initiated moves between G2 and G3 (demotions for the G2 free
watermark, promotions after G3 hits), sent to the workers as commands.

Runs in the leader, on its event loop. Owns the command transport (:mod:`.commands`, injected
at construction) and the in-flight state: at most one demotion and one promotion job at a
time. A command's acknowledgement counts only when the worker signed it
(:func:`kvbm_client.security.ack_is_authentic`); an unacknowledged job is left to expire (its
slots stay reserved until then, see :mod:`.jobs`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Sequence

from kvbm_client.config import KvbmConfig
from kvbm_client.contract import pb
from kvbm_client.ids import BlockHash, JobId, PlanKind, Tier, WorkerId
from kvbm_client.security import NodeKey, ack_is_authentic
from kvbm_client.tasks import TaskSet

from .commands import CommandTransport
from .commands.base import AckCheck
from .decisions import JobPlacement
from .events import KvEventFeed
from .jobs import Job
from .ledger import JobLedger
from .membership import Membership
from .metrics import LeaderMetrics
from .onboard_cost import OnboardCosts
from .placement import PlacementPolicy

log = logging.getLogger("kvbm.leader")


class Rebalancer:
    """See the module docstring."""

    def __init__(self, config: KvbmConfig, placement: PlacementPolicy, membership: Membership,
                 ledger: JobLedger, commands: CommandTransport, node_key: NodeKey,
                 metrics: LeaderMetrics, feed: KvEventFeed, costs: OnboardCosts | None = None) -> None:
        self.config = config
        self.placement = placement
        self.membership = membership
        self.ledger = ledger
        self.commands = commands
        self.node_key = node_key
        self.metrics = metrics
        self.feed = feed
        self.costs = costs or OnboardCosts()
        self._in_flight: set[PlanKind] = set()  # DEMOTE and/or PROMOTE
        self._tasks = TaskSet(log, "rebalancer command")  # the commands in flight (held until done)

    def in_flight(self, kind: PlanKind) -> bool:
        return kind in self._in_flight

    # ------------------------------------------------------------------ decisions
    def maybe_demote(self) -> None:
        """Below the G2 free watermark: drop or demote LRU blocks (one job in flight at a time)."""
        pool = self.placement.registry.pools.get(Tier.HOST)
        if pool is None or PlanKind.DEMOTE in self._in_flight or not self.membership.ready:
            return
        target = int(pool.capacity * self.config.host_free_watermark)
        if pool.allocator.num_free >= target:
            return
        self._launch(self.placement.prepare_demotion(self.ledger.jobs.next_id(), target))

    def maybe_promote(self, keys: Sequence[BlockHash]) -> None:
        """After a G3 hit, copy the blocks back to G2 (one promotion job in flight at a time)."""
        if not keys or PlanKind.PROMOTE in self._in_flight:
            return
        self._launch(self.placement.prepare_promotion(self.ledger.jobs.next_id(), keys))

    def _launch(self, plan: JobPlacement) -> None:
        """Count and log a demotion or promotion decision, and send it when it moves blocks."""
        self.feed.flush(self.placement.registry)
        self.metrics.inc("kvbm_evicted_blocks", plan.dropped)
        moves = plan.demotions if plan.kind is PlanKind.DEMOTE else plan.promotions
        what = "demotion decision" if plan.kind is PlanKind.DEMOTE else "promotion decision"
        if not moves:
            if plan.dropped:
                log.debug("%s: dropped %d G2 blocks (none worth G3)", what, plan.dropped)
            return
        job, signed = self.ledger.new(plan, None)
        log.debug("%s job=%d: %s %d blocks, demote %d, dropped %d", what, job.job_id,
                  "G2->G3" if plan.kind is PlanKind.DEMOTE else "G3->G2", len(moves), len(plan.demotions),
                  plan.dropped)
        self._dispatch(plan.kind, job, signed)

    # ------------------------------------------------------------------ commands
    def _dispatch(self, kind: PlanKind, job: Job, signed: "pb.SignedPlan") -> None:
        self._in_flight.add(kind)
        self._tasks.spawn(self._send(kind, job, signed), f"job={job.job_id}")

    async def _send(self, kind: PlanKind, job: Job, signed: "pb.SignedPlan") -> None:
        try:
            await asyncio.gather(*(self._command(w, job, signed) for w in job.expected))
        finally:
            self._in_flight.discard(kind)

    def _check(self, worker_id: WorkerId, job_id: JobId) -> AckCheck:
        def accept(resp: "pb.CommandResponse") -> bool:
            return ack_is_authentic(self.node_key, resp, worker_id, job_id)
        return accept

    async def _command(self, worker_id: WorkerId, job: Job, signed: "pb.SignedPlan") -> None:
        record = self.membership.workers.get(worker_id)
        if record is None:
            return
        sent = time.perf_counter()
        ack = await self.commands.send(record, pb.CommandRequest(plan=signed), self.config.job_timeout_secs,
                                       self._check(worker_id, job.job_id))
        promoted = len(job.placement.promotions) if job.placement.kind is PlanKind.PROMOTE else 0
        if ack.ok and promoted and record.layout is not None:  # a G3 read sample (see onboard_cost.py)
            self.costs.observe_promotion(promoted * record.layout.block_bytes, time.perf_counter() - sent)
        if ack.forged:
            log.error("command job=%d: %d acknowledgements over %s not signed by worker %s; ignored",
                      job.job_id, ack.forged, self.commands.name, worker_id)
        if ack.delivered:
            await self.ledger.report(job.job_id, worker_id, ack.ok, ack.error)
        else:  # the worker may still be copying: the job expires (and frees its slots) later
            self.metrics.inc("kvbm_commands_undelivered")
            log.warning("command job=%d to worker %s over %s not acknowledged: %s", job.job_id, worker_id,
                        self.commands.name, ack.error)

    def forget(self, worker_id: WorkerId) -> None:
        self.commands.forget(worker_id)

    async def close(self) -> None:
        """Cancel the commands in flight (their jobs expire with the leader)."""
        await self._tasks.close()
