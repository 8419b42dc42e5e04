"""The job ledger: every transfer job's life, from its plan to its settlement.

Runs in the leader, on its event loop. Owns the :class:`~.jobs.JobTable`, the signing of
plans, and the metrics a job counts when it settles. The placement decides *what* a job
moves (:mod:`.placement`); the ledger decides *when* its reservations become data or are
rolled back.

Protocol:

    new(placement, session) -> (Job, SignedPlan)   register a job, sign its wire plan
    start(job_id, worker, epoch, now) -> Job       a worker may move its first byte (StartTransfer)
    report(job_id, worker, ok, error, bad)         one worker's word (CompleteTransfer, command
                                                   acknowledgements); settles a decided job
    release(job, why)                              the client gives up (Release, session end)
    expire(now)                                    roll back jobs past their expiry (the tick)
    fail_all()                                     every job is void (a worker lost, a re-plan)

Invariants: a job settles once (it leaves the table before its copies are settled); a job a
worker started is never rolled back before that worker reported or the job expired
(deadline + grace), so a late copy never lands in a reused slot (see :mod:`.jobs`); a STORE
reported after its deadline is rolled back (its copy may have read engine blocks that the
engine had already reused), so its bytes are never served.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Sequence, cast

from kvbm_client.config import KvbmConfig
from kvbm_client.contract import pb, sign_plan
from kvbm_client.ids import BlockHash, JobId, PlanKind, SessionId, SlotId, Tier, WorkerId

from .decisions import JobPlacement, Outcome
from .events import KvEventFeed
from .jobs import Job, JobState, JobTable, StartRefused
from .membership import Membership
from .metrics import LeaderMetrics
from .onboard_cost import OnboardCosts
from .placement import PlacementPolicy
from .refusals import Refused, Why
from .slicing import YIELD_SECONDS, run_sliced
from .steps import CompletionStepper

log = logging.getLogger("kvbm.leader")
SIGN_SLICE = 8192  # plan entries copied into the wire form between two yields


def wire_tiers(tiers: Sequence[Tier]) -> "list[pb.Tier]":
    """Tiers as the wire enum: the same values (``Tier`` is an ``IntEnum``), so no copy."""
    return cast("list[pb.Tier]", tiers)


def short(keys: Sequence[BlockHash], n: int = 3) -> str:
    """The first hashes of a list, for one-line debug logs."""
    head = ",".join(k.hex()[:12] for k in keys[:n])
    return head + (f",…(+{len(keys) - n})" if len(keys) > n else "")


@dataclass(frozen=True)
class PlanSigner:
    """Signs the wire form of a job's placement with this leader incarnation's plan key."""

    leader_id: str
    key: bytes

    def _head(self, placement: JobPlacement, deadline: float, epoch: int) -> "pb.TransferPlan":
        p = placement
        return pb.TransferPlan(job_id=p.job_id, kind=cast("pb.PlanKind", p.kind), deadline=deadline, epoch=epoch,
                               leader_id=self.leader_id,
                               demote_host_slots=[d.host_slot for d in p.demotions],
                               demote_disk_slots=[d.disk_slot for d in p.demotions],
                               promote_host_slots=[d.host_slot for d in p.promotions],
                               promote_disk_slots=[d.disk_slot for d in p.promotions])

    def sign(self, placement: JobPlacement, deadline: float, epoch: int) -> "pb.SignedPlan":
        wire = self._head(placement, deadline, epoch)
        wire.tiers.extend(wire_tiers(placement.tiers))
        wire.slots.extend(placement.slots)
        return sign_plan(wire, self.key)

    async def sign_sliced(self, placement: JobPlacement, deadline: float, epoch: int) -> "pb.SignedPlan":
        """:meth:`sign`, the entries copied into the wire form a slice at a time (a 65536-entry
        plan takes tens of milliseconds to convert)."""
        wire = self._head(placement, deadline, epoch)
        tiers, slots = placement.tiers, placement.slots
        for start in range(0, len(tiers), SIGN_SLICE):
            if start:
                await asyncio.sleep(YIELD_SECONDS)
            wire.tiers.extend(wire_tiers(tiers[start:start + SIGN_SLICE]))
            wire.slots.extend(slots[start:start + SIGN_SLICE])
        return sign_plan(wire, self.key)


class JobLedger:
    """See the module docstring."""

    def __init__(self, config: KvbmConfig, placement: PlacementPolicy, membership: Membership,
                 metrics: LeaderMetrics, feed: KvEventFeed, signer: PlanSigner,
                 costs: OnboardCosts | None = None) -> None:
        self.config = config
        self.placement = placement
        self.membership = membership
        self.metrics = metrics
        self.feed = feed
        self.signer = signer
        self.costs = costs or OnboardCosts()
        self.jobs = JobTable()

    @property
    def grace(self) -> float:
        return self.config.job_timeout_secs

    # ------------------------------------------------------------------ new / start
    def _register(self, placement: JobPlacement, session: SessionId | None) -> tuple[Job, int]:
        pools = self.membership.pools
        assert pools is not None, "a job is planned only on ready pools"
        deadline = time.monotonic() + self.config.job_timeout_secs
        job = Job(placement, session, deadline, deadline + self.grace, frozenset(self.membership.members))
        self.jobs.add(job)
        return job, pools.epoch

    def new(self, placement: JobPlacement, session: SessionId | None) -> tuple[Job, "pb.SignedPlan"]:
        """Register a job and sign its plan at once (small plans: demotions, promotions)."""
        job, epoch = self._register(placement, session)
        return job, self.signer.sign(placement, job.deadline, epoch)

    async def issue(self, placement: JobPlacement, session: SessionId | None) -> tuple[Job, "pb.SignedPlan"]:
        """:meth:`new` for a client's plan of any size (signed in slices). NOTE: the job is
        registered first; if it is settled or reset meanwhile, its plan is refused at
        ``StartTransfer`` like any stale plan."""
        job, epoch = self._register(placement, session)
        return job, await self.signer.sign_sliced(placement, job.deadline, epoch)

    def start(self, job_id: JobId, worker_id: WorkerId, epoch: int, now: float) -> Job:
        """Let ``worker_id`` start ``job_id`` (``StartTransfer``), or raise :class:`Refused`."""
        pools = self.membership.pools
        if pools is None or epoch != pools.epoch:
            raise Refused(Why.NOT_LIVE, f"job {job_id} is of pool epoch {epoch}; pools are at "
                                        f"{pools.epoch if pools else 'none'}")
        job = self.jobs.start(job_id, worker_id, now)
        if isinstance(job, StartRefused):
            log.warning("worker %s may not start job %d: %s", worker_id, job_id, job.value)
            why = Why.LATE if job is StartRefused.LATE else Why.NOT_LIVE
            raise Refused(why, f"job {job_id} is {job.value}; move nothing")
        return job

    # ------------------------------------------------------------------ reports
    async def report(self, job_id: JobId, worker_id: WorkerId, ok: bool, error: str,
                     bad: Sequence[tuple[Tier, SlotId]] = (), moved: tuple[int, float] = (0, 0.0)) -> JobState | None:
        """One worker's word on a job; settles the job once it is decided and fully reported.
        None: late (already settled: expired, released or pools re-planned). ``moved``: the
        worker's bytes and seconds on its lane (a successful LOAD is a bandwidth sample).

        A STORE reported after its deadline fails: the engine may have taken back the blocks
        its copy read (its connector waits for a store until the deadline plus a margin, then
        the engine reuses them), so what was stored is never served."""
        pending = self.jobs.get(job_id)
        late = pending is not None and time.monotonic() > pending.deadline
        if ok and late and pending is not None and pending.placement.kind is PlanKind.STORE:
            ok, error = False, "store reported after its deadline (the engine may have reused the blocks it read)"
        job = self.jobs.report(job_id, worker_id, ok, error)
        if job is None:
            return None
        if ok and not bad and job.placement.kind is PlanKind.LOAD:
            self.costs.observe_load(job.placement.tiers, *moved)
        if bad:
            self._condemn(job, worker_id, bad)
        if not ok:
            log.warning("worker %s failed job %d: %s", worker_id, job_id, error)
        state = job.state
        if state is JobState.CONFIRMED:
            await self.settle(job, True)
        elif state is JobState.FAILED and job.all_reported:
            await self.settle(job, False, job.error)
        return state

    def _condemn(self, job: Job, worker_id: WorkerId, bad: Sequence[tuple[Tier, SlotId]]) -> None:
        dropped = self.placement.condemn_slots(job.placement, bad)
        self.metrics.inc("kvbm_corrupt_blocks", dropped)
        self.feed.flush(self.placement.registry)
        slots = {t: sorted(s for tt, s in bad if tt is t) for t in (Tier.HOST, Tier.DISK)}
        log.warning("job %d: worker %s found bad bytes in G2 slots %s, G3 slots %s: %d copies dropped, "
                    "never matched again", job.job_id, worker_id, slots[Tier.HOST][:8], slots[Tier.DISK][:8],
                    dropped)

    # ------------------------------------------------------------------ release / expiry
    async def release(self, job: Job, why: str) -> None:
        """A load no worker was told to start only needs its pins back; slots a worker may
        still read or write (a started job, a store, a demotion) stay reserved until every
        started worker reported or the job expires."""
        if job.placement.kind is PlanKind.LOAD and not job.reported and not job.started:
            await self.settle(job, False, why)
        else:
            self.jobs.fail(job.job_id, why)

    async def end_session(self, session: SessionId, why: str) -> None:
        for job in self.jobs.of_session(session):
            if job.state is JobState.PENDING:
                await self.release(job, why)

    async def expire(self, now: float) -> None:
        for job in self.jobs.due(now):
            if self.jobs.get(job.job_id) is job:  # not settled by a report meanwhile
                await self.settle(job, False, job.error or "deadline passed")

    def fail_all(self) -> int:
        """Forget every job (the caller resets the placement: their copies go with it);
        each counts as a failed job. Returns how many there were."""
        jobs = self.jobs.clear()
        self.metrics.inc("kvbm_failed_jobs", len(jobs))
        return len(jobs)

    # ------------------------------------------------------------------ settle
    async def settle(self, job: Job, success: bool, why: str = "") -> Outcome:
        """Commit or roll back a job and count what it did (in slices: a big job's copies
        become ready a slice at a time, which is a consistent state throughout)."""
        self.jobs.pop(job.job_id)
        stepper = CompletionStepper(self.placement, job.placement, success)
        await run_sliced(stepper, self.placement)
        outcome = stepper.outcome
        self.feed.stored(self.placement.registry, outcome.ready)
        m = self.metrics
        m.inc("kvbm_offload_blocks_d2h", outcome.stored[Tier.HOST])
        m.inc("kvbm_offload_blocks_d2d", outcome.stored[Tier.DISK])
        m.inc("kvbm_offload_blocks_h2d", outcome.demoted)
        m.inc("kvbm_onboard_blocks_h2d", outcome.loaded[Tier.HOST])
        m.inc("kvbm_onboard_blocks_d2d", outcome.loaded[Tier.DISK])
        m.inc("kvbm_promoted_blocks", outcome.promoted)
        if not success:
            m.inc("kvbm_failed_jobs")
        p = job.placement
        log.debug("%s job=%d %s: %d blocks, %d demotions, %d promotions%s", p.kind.name.lower(), job.job_id,
                  "committed" if success else "rolled back", len(p.keys), len(p.demotions), len(p.promotions),
                  f" ({why})" if why else "")
        return outcome
