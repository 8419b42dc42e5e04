"""Why the worker refuses or fails a request, as the status every transport answers with.

Runs in the worker daemon. The core (plan check, job runner, region registry) raises these;
the gRPC servicer turns them into ``context.abort(code, message)`` and the NATS command
adapter into a signed ``CommandResponse(ok=False)``, so no core code knows a transport.
"""
from __future__ import annotations

from typing import Sequence

import grpc

from kvbm_client.ids import JobId, SlotId, Tier


class Refusal(Exception):
    """A request the worker will not (or could not) carry out, with its gRPC status.

    Args:
        code: the status a caller gets (``grpc.StatusCode``).
        message: the reason, for the caller and the log.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class PlanRejected(Refusal):
    """The request fails a check before anything moved (:mod:`kvbm_worker.plan_check`).

    ``job_id`` is the plan's job when its signature verified (the NATS adapter signs its
    rejection then), None when the plan could not be trusted.
    """

    def __init__(self, code: grpc.StatusCode, message: str, job_id: JobId | None = None) -> None:
        super().__init__(code, message)
        self.job_id = job_id


class JobFailed(Refusal):
    """A transfer job that passed its checks but did not complete; every caller of that job
    (a second ``Transfer`` joins the first) gets the same status."""


class CopyFailed(JobFailed):
    """A job that the leader let start and that failed on its lane; ``bad`` names the slots
    whose bytes failed verification or could not be read (reported to the leader)."""

    def __init__(self, code: grpc.StatusCode, message: str, bad: dict[Tier, list[SlotId]] | None = None) -> None:
        super().__init__(code, message)
        self.bad: dict[Tier, list[SlotId]] = bad or {}


class RegionRejected(Refusal):
    """A region registration or removal the worker refuses."""


class SlotsFailed(Exception):
    """Slots of a worker tier whose bytes failed verification (checksum mismatch) or could not
    be read (short read, I/O error, timeout): the load fails with DATA_LOSS and the leader
    drops those copies (``CompleteTransferRequest.bad_*_slots``).

    Raised on a lane thread by :class:`kvbm_worker.mover.BlockMover`.
    """

    def __init__(self, tier: Tier, slots: Sequence[int], reason: str) -> None:
        super().__init__(f"{tier.label} slots {list(slots)[:8]}{' ...' if len(slots) > 8 else ''}: {reason}")
        self.tier = tier
        self.slots = [SlotId(int(s)) for s in slots]
        self.reason = reason


class CopyExpired(Exception):
    """A copy reached the point where the leader may already have handed its slots to another
    block (the job's deadline plus part of the leader's grace): it stops there."""
