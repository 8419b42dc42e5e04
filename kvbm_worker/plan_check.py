"""The plan check: may this signed plan move bytes between these pools and this region?

Pure and synchronous (no I/O, no clock of its own): the gRPC servicer and the NATS command
adapter both call it and map its :class:`~kvbm_worker.errors.PlanRejected` to their answer.

Checks, in order (the first that fails decides the status):

1. the worker is attached to a leader (UNAVAILABLE), the plan is signed with that leader's
   plan key (PERMISSION_DENIED), and is for the current pool epoch (FAILED_PRECONDITION);
2. every demotion/promotion slot lies in its tier (OUT_OF_RANGE), paired lists have equal
   lengths (INVALID_ARGUMENT), and so do ``tiers`` and ``slots``; every slot lies in its tier
   (OUT_OF_RANGE; G1 is no pool tier);
3. the kind fits the call (INVALID_ARGUMENT); a transfer names one engine block per entry
   (INVALID_ARGUMENT), each inside the region (OUT_OF_RANGE), and a load writes no engine
   block twice (INVALID_ARGUMENT); a stage (no engine blocks yet) is a LOAD (INVALID_ARGUMENT)
   of G2 entries only (FAILED_PRECONDITION).

NOTE: every id is read as unsigned 64-bit *before* any conversion: ``2**64 - 1`` read as
int64 is -1, which passes ``< num_blocks`` and addresses the region's last block.

The deadline is not checked here: a second ``Transfer`` may join a running job after it.
:func:`check_not_late` is for new jobs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import grpc
import numpy as np
import numpy.typing as npt

from kvbm_client.contract import pb, verify_plan
from kvbm_client.ids import JobId, PlanKind, Tier

from .errors import PlanRejected
from .id_arrays import NO_BLOCKS, NO_SLOTS, EngineBlocks, Slots
from .jobs import JobKey
from .lanes import Lane

Code = grpc.StatusCode
#: Engine block ids or slots, one per plan entry, already range-checked (so int64 is exact).
Ids = npt.NDArray[np.int64]
_NONE: Ids = np.zeros(0, np.int64)


class PoolSlots(Protocol):
    """What the check needs of the allocated pools (:class:`kvbm_worker.allocation.Pools`)."""

    @property
    def epoch(self) -> int: ...

    def slots(self, tier: Tier) -> int: ...


class RegionShape(Protocol):
    """What the check needs of the engine region (:class:`kvbm_worker.regions.EngineRegion`)."""

    @property
    def num_blocks(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Batch:
    """A checked plan in the worker's terms: what one job moves."""

    kind: PlanKind
    job: JobKey
    deadline: float  # the plan's, CLOCK_MONOTONIC seconds
    tiers: Ids = field(default_factory=lambda: _NONE)  # Tier of each entry
    slots: Slots = field(default_factory=lambda: NO_SLOTS)
    engine_blocks: EngineBlocks = field(default_factory=lambda: NO_BLOCKS)
    demote_host: Slots = field(default_factory=lambda: NO_SLOTS)
    demote_disk: Slots = field(default_factory=lambda: NO_SLOTS)
    promote_host: Slots = field(default_factory=lambda: NO_SLOTS)
    promote_disk: Slots = field(default_factory=lambda: NO_SLOTS)

    @property
    def job_id(self) -> JobId:
        return JobId(self.job.job_id)

    @property
    def lane(self) -> Lane:
        """Loads run on the load lane; stores, demotions and promotions on the store lane."""
        return Lane.LOAD if self.kind is PlanKind.LOAD else Lane.STORE

    def entries(self, tier: Tier) -> tuple[EngineBlocks, Slots]:
        """The (engine blocks, slots) of the entries in ``tier``, in plan order."""
        picks = np.flatnonzero(self.tiers == int(tier))
        return EngineBlocks(self.engine_blocks[picks]), Slots(self.slots[picks])


def unsigned(values: Sequence[int], limit: int, what: str, job_id: JobId | None = None) -> Ids:
    """``values`` as int64 once each is known to be in ``0 .. limit-1`` (read as uint64 first)."""
    ids = np.asarray(values, np.uint64)
    if ids.size and int(ids.max()) >= limit:
        bad = int(ids.max())
        raise PlanRejected(Code.OUT_OF_RANGE, f"{what} {bad} outside 0..{limit - 1}" if limit else
                           f"{what} {bad}: none exist", job_id)
    return ids.astype(np.int64)


def _has_duplicates(values: Ids) -> bool:
    # NOTE: not np.unique: its first call imports numpy.ma, which blocked the event loop for
    # 46 ms on the H100 host (the first load after start; DYN_LOG=debug "event loop stalled").
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def verified(signed: "pb.SignedPlan", key: bytes | None, pools: PoolSlots | None) -> "pb.TransferPlan":
    """Steps 1 and 2 of the module docstring: the plan, if this node's leader signed it for the
    pools we have."""
    if key is None:
        raise PlanRejected(Code.UNAVAILABLE, "worker is not attached to a leader")
    plan = verify_plan(signed, key)
    if plan is None:
        raise PlanRejected(Code.PERMISSION_DENIED, "plan is not signed by this node's leader")
    job = JobId(plan.job_id)
    if pools is None or plan.epoch != pools.epoch:
        raise PlanRejected(Code.FAILED_PRECONDITION, f"plan for pool epoch {plan.epoch}; pools are at "
                           f"{pools.epoch if pools is not None else 'none'}", job)
    for name, listed, tier in (("demote_host_slots", plan.demote_host_slots, Tier.HOST),
                              ("demote_disk_slots", plan.demote_disk_slots, Tier.DISK),
                              ("promote_host_slots", plan.promote_host_slots, Tier.HOST),
                              ("promote_disk_slots", plan.promote_disk_slots, Tier.DISK)):
        limit = pools.slots(tier)
        bad = next((s for s in listed if s >= limit), None)
        if bad is not None:
            raise PlanRejected(Code.OUT_OF_RANGE, f"{name}: slot {bad} >= {limit}", job)
    if (len(plan.demote_host_slots) != len(plan.demote_disk_slots)
            or len(plan.promote_host_slots) != len(plan.promote_disk_slots)):
        raise PlanRejected(Code.INVALID_ARGUMENT, "demotion slot lists differ in length", job)
    if len(plan.tiers) != len(plan.slots):
        raise PlanRejected(Code.INVALID_ARGUMENT, "plan tiers and slots differ in length", job)
    tiers = np.asarray(plan.tiers, np.int64)
    slots = np.asarray(plan.slots, np.uint64)
    limits = np.where(tiers == Tier.HOST, pools.slots(Tier.HOST),
                      np.where(tiers == Tier.DISK, pools.slots(Tier.DISK), 0)).astype(np.uint64)
    bad_at = np.flatnonzero(slots >= limits)
    if bad_at.size:
        i = int(bad_at[0])
        raise PlanRejected(Code.OUT_OF_RANGE, f"slot {int(slots[i])} outside tier {int(tiers[i])} of "
                           f"{int(limits[i])} slots", job)
    return plan


def _batch(plan: "pb.TransferPlan", kind: PlanKind, blocks: EngineBlocks = NO_BLOCKS) -> Batch:
    def ids(values: Sequence[int]) -> Slots:  # range-checked in verified()
        return Slots(np.asarray(values, np.uint64).astype(np.int64))
    return Batch(kind, JobKey(plan.leader_id, plan.epoch, JobId(plan.job_id)), plan.deadline,
                 np.asarray(plan.tiers, np.int64), ids(plan.slots), blocks, ids(plan.demote_host_slots),
                 ids(plan.demote_disk_slots), ids(plan.promote_host_slots), ids(plan.promote_disk_slots))


def check_transfer(signed: "pb.SignedPlan", key: bytes | None, pools: PoolSlots | None,
                   region: RegionShape, engine_blocks: Sequence[int]) -> Batch:
    """A ``Transfer``: a STORE or LOAD plan and the engine block of each of its entries."""
    plan = verified(signed, key, pools)
    job = JobId(plan.job_id)
    if int(plan.kind) not in (PlanKind.STORE, PlanKind.LOAD):
        raise PlanRejected(Code.INVALID_ARGUMENT, f"plan kind {plan.kind} is not a transfer", job)
    kind = PlanKind(plan.kind)
    if len(engine_blocks) != len(plan.slots):
        raise PlanRejected(Code.INVALID_ARGUMENT,
                           f"{len(engine_blocks)} engine blocks for a plan of {len(plan.slots)} entries", job)
    blocks = EngineBlocks(unsigned(engine_blocks, region.num_blocks, "engine block", job))
    if kind is PlanKind.LOAD and _has_duplicates(blocks):
        raise PlanRejected(Code.INVALID_ARGUMENT, "a load writes one engine block twice", job)
    return _batch(plan, kind, blocks)


def check_stage(signed: "pb.SignedPlan", key: bytes | None, pools: PoolSlots | None) -> Batch:
    """A staged ``Transfer`` (:mod:`kvbm_worker.stages`): a LOAD plan of G2 entries, before its
    engine blocks are known (the call that names them is checked by :func:`check_transfer`)."""
    plan = verified(signed, key, pools)
    job = JobId(plan.job_id)
    if int(plan.kind) != PlanKind.LOAD:
        raise PlanRejected(Code.INVALID_ARGUMENT, f"plan kind {plan.kind}: only a load is staged", job)
    if any(int(t) != Tier.HOST for t in plan.tiers):
        raise PlanRejected(Code.FAILED_PRECONDITION, "a load with G3 entries lands whole blocks: nothing to stage", job)
    return _batch(plan, PlanKind.LOAD)


def check_command(signed: "pb.SignedPlan", key: bytes | None, pools: PoolSlots | None) -> Batch:
    """A leader ``Command``: a DEMOTE or PROMOTE plan (no engine memory is touched)."""
    plan = verified(signed, key, pools)
    if int(plan.kind) not in (PlanKind.DEMOTE, PlanKind.PROMOTE):
        raise PlanRejected(Code.INVALID_ARGUMENT, f"plan kind {plan.kind} is not a command", JobId(plan.job_id))
    return _batch(plan, PlanKind(plan.kind))


def check_not_late(batch: Batch, now: float) -> None:
    """A new job may start only before its deadline (``now``: CLOCK_MONOTONIC seconds)."""
    if now >= batch.deadline:
        raise PlanRejected(Code.DEADLINE_EXCEEDED, f"job {batch.job_id} is past its deadline", batch.job_id)
