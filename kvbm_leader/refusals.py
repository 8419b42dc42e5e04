"""Why the leader refuses a request: one exception the units raise, one map to gRPC.

Runs in the leader. The units (sessions, planner, ledger, fleet) decide; they raise
:class:`Refused` with a :class:`Why` and a message that names the numbers. The gRPC servicer
(:mod:`.servicer`) is the only place that turns a :class:`Why` into a status code.
"""
from __future__ import annotations

import enum


class Why(enum.Enum):
    INVALID = "invalid argument"  # malformed or out of bounds, whatever the node's state
    UNKNOWN = "unknown"  # no such session, job or worker
    DUPLICATE = "already exists"  # a worker id attached twice
    EXHAUSTED = "resource exhausted"  # over a limit (sessions, a tier's capacity)
    NOT_LIVE = "failed precondition"  # a job that may not start (settled, released, other epoch)
    LATE = "deadline exceeded"  # a job past its deadline
    CLOSING = "unavailable"  # the leader is shutting down


class Refused(Exception):
    """A request the leader will not serve; nothing changed."""

    def __init__(self, why: Why, message: str) -> None:
        super().__init__(message)
        self.why = why
        self.message = message
