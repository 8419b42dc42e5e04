"""The request planner: a client's ``Match``, ``PrepareStore`` and ``PrepareLoad`` turned into
placement decisions and signed jobs, with bounded work per request.

Runs in the leader, on its event loop. Each request runs its stepper (:mod:`.steps`) in
slices (:mod:`.slicing`), so a 65536-key request lets other clients' calls in every few
milliseconds. Limits: a store that needs more slots than its tier has is refused
(``Why.EXHAUSTED``), never a flush of the tier; each new block evicts at most one block, so a
client never evicts more than it stores. A request overtaken by a reset (a worker lost, pools
re-planned) answers as if the pools were not ready; one whose session ended meanwhile is
rolled back and refused. A load's hit (``count_hit``: the frequency the G2 -> G3 offload
filter reads) is counted after its answer, off the lookup's critical path.
``DYN_LOG=debug`` logs one line per offload and onboard decision.

A load is cost-aware (:mod:`.onboard_cost`) when the client sends its prefill speed: the
stepper pins the matched prefix, the decision keeps the head worth loading, the tail is
unpinned before the plan is signed (so the client sees one answer, one round trip), and the
tail's G3 blocks are promoted to G2 with the loaded ones (at most one promotion job in flight:
a hit that finds one running promotes nothing, and the next hit on those blocks tries again).
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

from kvbm_client.contract import MatchResult, pb
from kvbm_client.ids import BlockHash, JobId, PlanKind, SessionId, Tier
from kvbm_client.tasks import TaskSet

from .decisions import JobPlacement
from .events import KvEventFeed
from .ledger import JobLedger, short
from .membership import Membership
from .metrics import LeaderMetrics
from .onboard_cost import OnboardCosts, OnboardDecision, OnboardReason
from .placement import PlacementPolicy
from .rebalancer import Rebalancer
from .refusals import Refused, Why
from .sessions import SessionTable
from .slicing import run_sliced
from .steps import CompletionStepper, HitStepper, LoadStepper, MatchStepper, StoreStepper

log = logging.getLogger("kvbm.leader")

Planned = tuple[JobPlacement, "pb.SignedPlan | None"]
NO_JOB = JobId(0)  # the id of an answer that planned nothing (job ids start at 1)


class RequestPlanner:
    """See the module docstring."""

    def __init__(self, placement: PlacementPolicy, membership: Membership, ledger: JobLedger,
                 rebalancer: Rebalancer, sessions: SessionTable, feed: KvEventFeed, metrics: LeaderMetrics,
                 costs: OnboardCosts | None = None) -> None:
        self.placement = placement
        self.membership = membership
        self.ledger = ledger
        self.rebalancer = rebalancer
        self.sessions = sessions
        self.feed = feed
        self.metrics = metrics
        self.costs = costs or OnboardCosts()
        self._hits = TaskSet(log, "hit count")  # loads' hits being counted (held until done)

    # ------------------------------------------------------------------ lookups
    async def match(self, keys: Sequence[BlockHash], count_hit: bool, tokens_per_block: int) -> MatchResult:
        if not self.membership.ready:
            return MatchResult(0, ())
        stepper = MatchStepper(self.placement, keys, count_hit)
        if not await run_sliced(stepper, self.placement):
            return MatchResult(0, ())
        result = stepper.result
        if count_hit:
            self._count_lookup(len(keys), result, tokens_per_block)
        log.debug("match: %d/%d blocks [%s]", result.num_matched, len(keys),
                  ",".join(t.label for t in result.tiers[:8]))
        return result

    def count_unasked(self, blocks: int) -> None:
        """A client answered lookups of ``blocks`` blocks as misses itself (the presence filter
        ruled out their first block): they count as looked up, none matched."""
        if blocks:
            self.metrics.hits.add(blocks, 0, 0)
            self.metrics.inc("kvbm_presence_filter_misses", blocks)
            log.debug("lookups answered by a client's presence filter: %d blocks, none stored", blocks)

    def _count_lookup(self, queried: int, result: MatchResult, tokens_per_block: int) -> None:
        host = result.tiers.count(Tier.HOST)
        self.metrics.hits.add(queried, host, result.num_matched - host)
        self.metrics.inc("kvbm_matched_tokens", result.num_matched * (tokens_per_block or 1))

    # ------------------------------------------------------------------ store
    def _check_size(self, keys: Sequence[BlockHash]) -> None:
        tier = self.placement.store_tier
        if tier is None:
            return
        capacity = self.placement.capacity(tier)
        if len(keys) <= capacity:
            return  # cannot need more (the count below is a pass over the keys: only when it may)
        needed = self.placement.slots_needed(keys)
        if needed > capacity:
            raise Refused(Why.EXHAUSTED, f"a store of {needed} new blocks; {tier.label} holds {capacity} blocks "
                                         "(store at most that many per request)")

    async def prepare_store(self, session: SessionId, keys: Sequence[BlockHash],
                            parents: Sequence[BlockHash | None] | None) -> Planned:
        if not self.membership.ready:
            self.metrics.inc("kvbm_offload_skipped_full", len(keys))
            log.debug("offload skipped: %d blocks, pools not ready", len(keys))
            return JobPlacement(NO_JOB, PlanKind.STORE, skipped_full=len(keys)), None
        self._check_size(keys)
        stepper = StoreStepper(self.placement, self.ledger.jobs.next_id(), keys, parents)
        if not await run_sliced(stepper, self.placement):  # its reservations went with the old pools
            return JobPlacement(stepper.plan.job_id, PlanKind.STORE, skipped_full=len(keys)), None
        plan = stepper.plan
        self.feed.planned(plan.keys)
        await self._require_session(session, plan)
        m = self.metrics
        m.inc("kvbm_offload_skipped_present", plan.skipped_present)
        m.inc("kvbm_offload_skipped_full", plan.skipped_full)
        m.inc("kvbm_evicted_blocks", plan.dropped)
        m.inc("kvbm_offload_skipped_demotions", plan.skipped_demotions)
        signed = (await self.ledger.issue(plan, session))[1] if not plan.is_empty else None
        self.feed.flush(self.placement.registry)
        log.debug("offload decision job=%d: store %d to %s [%s], present %d, full %d, demote %d, dropped %d "
                  "(%d past the demotion limit)", plan.job_id, len(plan.keys),
                  plan.tiers[0].label if plan.tiers else "-", short(plan.keys), plan.skipped_present,
                  plan.skipped_full, len(plan.demotions), plan.dropped, plan.skipped_demotions)
        self.rebalancer.maybe_demote()
        return plan, signed

    # ------------------------------------------------------------------ load
    async def prepare_load(self, session: SessionId, keys: Sequence[BlockHash], count_hit: bool,
                           tokens_per_block: int, prefill_tokens_per_s: float = 0.0,
                           on_signed: Callable[[JobPlacement, "pb.SignedPlan"], None] | None = None) -> Planned:
        """``on_signed``: called with a non-empty plan as soon as it is signed, before any other
        work of this lookup is queued on the loop (the plan's stage is sent from there)."""
        if not self.membership.ready:
            return JobPlacement(NO_JOB, PlanKind.LOAD), None
        stepper = LoadStepper(self.placement, self.ledger.jobs.next_id(), keys)
        if not await run_sliced(stepper, self.placement):  # its pins went with the old pools
            return JobPlacement(NO_JOB, PlanKind.LOAD), None
        plan = stepper.plan
        hits = list(plan.keys) if count_hit else []  # the same prefix a match would find
        matched = MatchResult(len(plan.keys), tuple(plan.tiers))
        decision = self.costs.decide(plan.tiers, self.membership.shard_bytes(), tokens_per_block,
                                     prefill_tokens_per_s)
        skipped = await self._trim(plan, decision.num_load)
        if skipped is None:  # reset while the tail was unpinned: every pin went with the old pools
            return JobPlacement(NO_JOB, PlanKind.LOAD), None
        await self._require_session(session, plan)
        if count_hit:  # the same prefix a match would find: count it without a second pass
            self._count_lookup(len(keys), matched, tokens_per_block)
        if matched.num_matched:
            self.metrics.count_onboard(decision.reason.value, decision.num_skipped)
        signed = (await self.ledger.issue(plan, session))[1] if plan.keys else None
        if signed is not None and on_signed is not None:
            try:
                on_signed(plan, signed)
            except Exception:  # (a stage is a head start: the lookup's answer does not depend on it)
                log.exception("job %d load: its stage could not be sent", plan.job_id)
        if hits:  # a hit each, without a second pass, once this answer is on its way (over a quarter
            # of the lookup's work at 20K tokens), in slices like any request's work; its only reader
            # is the G2 -> G3 offload filter, a heuristic: a decision made meanwhile sees the hit late
            self._hits.spawn(run_sliced(HitStepper(self.placement, hits), self.placement), f"job={plan.job_id}")
        promote = [k for k, t in zip(plan.keys, plan.tiers) if t is Tier.DISK] if Tier.DISK in plan.tiers else []
        promote += skipped
        if log.isEnabledFor(logging.DEBUG):
            log.debug("onboard decision job=%d: load %d/%d [%s] from %s; %s, promote %d", plan.job_id,
                      len(plan.keys), len(keys), short(plan.keys),
                      ",".join(sorted({t.label for t in set(plan.tiers)})) or "-",
                      _cost_text(decision, matched, tokens_per_block, prefill_tokens_per_s), len(promote))
        self.rebalancer.maybe_promote(promote)
        return plan, signed

    async def _trim(self, plan: JobPlacement, num_load: int) -> list[BlockHash] | None:
        """Keep the first ``num_load`` entries of a pinned load and unpin the rest (returned:
        their G3 blocks, to promote). None: the placement was reset meanwhile."""
        if num_load >= len(plan.keys):
            return []
        tail = JobPlacement(plan.job_id, PlanKind.LOAD, plan.keys[num_load:], plan.tiers[num_load:],
                            plan.slots[num_load:])
        if not await run_sliced(CompletionStepper(self.placement, tail, False), self.placement):
            return None
        del plan.keys[num_load:], plan.tiers[num_load:], plan.slots[num_load:]
        plan.skipped_cost = len(tail.keys)
        return [k for k, t in zip(tail.keys, tail.tiers) if t is Tier.DISK]

    async def _require_session(self, session: SessionId, plan: JobPlacement) -> None:
        """The session may have ended while the request was planned in slices: then nobody
        owns the plan; roll it back and refuse."""
        if self.sessions.get(session) is not None:
            return
        await run_sliced(CompletionStepper(self.placement, plan, False), self.placement)
        self.feed.flush(self.placement.registry)
        raise Refused(Why.UNKNOWN, f"unknown or expired session {session!r}; open a new one")


def _cost_text(d: OnboardDecision, matched: MatchResult, tokens_per_block: int, prefill: float) -> str:
    """The estimates behind an onboard decision, for its debug line."""
    if d.reason is OnboardReason.UNCHECKED:
        return "no cost check"
    host = sum(1 for t in matched.tiers if t is Tier.HOST)
    return (f"{d.reason.value}: matched {d.num_matched} blocks ({host} G2, {d.num_matched - host} G3, "
            f"{d.num_matched * tokens_per_block} tokens), load {d.load_s * 1e3:.2f} ms "
            f"(all {d.load_all_s * 1e3:.2f} ms) vs recompute {d.recompute_s * 1e3:.2f} ms at {prefill:.0f} tok/s, "
            f"skip {d.num_skipped}")
