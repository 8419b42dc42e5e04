"""What a prepared batch is on the client side: a :class:`TransferHandle` built from the
leader's answer (its signed plan), and the :class:`TransferResult` of a finished one.

Shared by the asyncio client, the blocking leader session and the engine connectors.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .contract import pb
from .ids import JobId, PlanKind

__all__ = ["TransferHandle", "TransferResult", "plan_handle", "load_handle", "store_handle"]


@dataclass
class TransferHandle:
    """A batch in flight. ``num_blocks`` entries of the request were planned."""

    kind: PlanKind
    job_id: JobId | None
    num_blocks: int
    indices: tuple[int, ...] = ()  # STORE: which request entries were planned
    skipped_present: int = 0
    skipped_full: int = 0
    deadline: float = 0.0
    signed: "pb.SignedPlan | None" = None
    tasks: "list[asyncio.Future[pb.TransferResponse]]" = field(default_factory=list)
    #: LOAD: matched blocks after the planned ones left to recompute (cheaper than loading)
    skipped_cost: int = 0

    @property
    def is_empty(self) -> bool:
        return self.job_id is None


@dataclass(frozen=True)
class TransferResult:
    job_id: JobId | None
    num_blocks: int
    bytes: int
    seconds: float


def plan_handle(kind: PlanKind, signed: "pb.SignedPlan | None", n: int, indices: tuple[int, ...],
                present: int = 0, full: int = 0) -> TransferHandle:
    """A :class:`TransferHandle` for a leader's answer (``signed``: its SignedPlan, or None)."""
    if signed is None:
        return TransferHandle(kind, None, 0, (), present, full)
    plan = pb.TransferPlan()
    plan.ParseFromString(signed.plan)
    return TransferHandle(kind, JobId(plan.job_id), n, indices, present, full, plan.deadline, signed)


def load_handle(resp: "pb.PrepareLoadResponse") -> TransferHandle:
    """The handle of a leader's ``PrepareLoad`` answer."""
    handle = plan_handle(PlanKind.LOAD, resp.plan if resp.HasField("plan") else None, resp.num_planned,
                         tuple(range(resp.num_planned)))
    handle.skipped_cost = resp.num_skipped
    return handle


def store_handle(resp: "pb.PrepareStoreResponse") -> TransferHandle:
    """The handle of a leader's ``PrepareStore`` answer (``indices``: the entries planned)."""
    return plan_handle(PlanKind.STORE, resp.plan if resp.HasField("plan") else None, len(resp.indices),
                       tuple(resp.indices), resp.skipped_present, resp.skipped_full)
