"""The leader session every client holds, as pure decisions (no I/O).

Protocol, the same for the asyncio client (:class:`~kvbm_client.client.AsyncKvbmClient`)
and the blocking one (:class:`~kvbm_client.leader_session.LeaderSession`), which are thin
I/O shells around a :class:`SessionCore`:

1. ``OpenSession`` (:meth:`SessionCore.open_request`) → :meth:`SessionCore.opened`; a failure
   becomes :meth:`SessionCore.open_error`.
2. Every ``renew_every_s``: ``KeepAlive``; when it fails and :meth:`SessionCore.reopen_after`
   says so (the leader restarted or the session expired), open a new session.
3. Each call: :meth:`SessionCore.stamp` the request with the current session id; when it fails
   and :meth:`SessionCore.retry_after` says so, open a new session and send it once more.
4. ``CloseSession`` (best effort) when the client closes; the leader drops the session's pins.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc

from .contract import pb
from .errors import KvbmError, KvbmUnavailableError, from_rpc_error
from .ids import SessionId, WorkerId

#: The leader's words for a session it does not know (``NOT_FOUND``).
UNKNOWN_SESSION = "unknown or expired session"


def session_lost(exc: grpc.RpcError) -> bool:
    """The leader does not know our session (it restarted, or the session expired)."""
    return exc.code() == grpc.StatusCode.NOT_FOUND and UNKNOWN_SESSION in (exc.details() or "")


@dataclass
class SessionCore:
    """What a client knows of its leader session, and what to do on each outcome.

    Owned by one client shell; not thread-safe by itself (the shells call it from one loop
    or, for the renewer thread, only assign whole values).
    """

    client_name: str
    session_id: SessionId = SessionId("")
    ttl_s: float = 10.0
    #: the leader's limit of hashes per request
    max_hashes: int = 0
    #: the node's workers as the leader listed them when the session opened
    workers: dict[WorkerId, "pb.WorkerInfo"] = field(default_factory=dict)
    #: the leader's id, and its presence filter (:mod:`kvbm_client.presence`; "" / 0: none)
    leader_id: str = ""
    presence_path: str = ""
    presence_slots: int = 0

    def open_request(self) -> "pb.OpenSessionRequest":
        return pb.OpenSessionRequest(client_name=self.client_name)

    def opened(self, resp: "pb.OpenSessionResponse") -> None:
        """Take a new session (``OpenSession``'s answer)."""
        self.session_id = SessionId(resp.session_id)
        self.ttl_s = resp.ttl_ms / 1000
        self.max_hashes = resp.max_hashes
        self.workers = {WorkerId(w.worker_id): w for w in resp.workers}
        self.leader_id = resp.leader_id
        self.presence_path, self.presence_slots = resp.presence_path, resp.presence_slots

    @staticmethod
    def open_error(exc: grpc.RpcError, address: str, timeout: float) -> KvbmError:
        """The error a failed ``OpenSession`` raises: no answer in time is "unavailable"."""
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return KvbmUnavailableError(f"open session at {address}: no leader answered within {timeout:g}s")
        return from_rpc_error(exc, f"open session at {address}")

    @property
    def renew_every_s(self) -> float:
        """Renew three times per TTL (also the ``KeepAlive`` deadline)."""
        return self.ttl_s / 3

    def keepalive_request(self) -> "pb.KeepAliveRequest":
        return pb.KeepAliveRequest(session_id=self.session_id)

    def close_request(self) -> "pb.CloseSessionRequest":
        return pb.CloseSessionRequest(session_id=self.session_id)

    @staticmethod
    def reopen_after(exc: grpc.RpcError) -> bool:
        """A failed ``KeepAlive``: open a new session (else just try again next period)."""
        return session_lost(exc)

    def stamp(self, request: Any) -> None:
        """Put the current session id in ``request`` (requests without one are left alone)."""
        if "session_id" in type(request).DESCRIPTOR.fields_by_name:
            request.session_id = self.session_id

    @staticmethod
    def retry_after(exc: grpc.RpcError, attempt: int, request: Any) -> bool:
        """A failed call: open a new session and send ``request`` again (once)."""
        return attempt == 0 and session_lost(exc) and "session_id" in type(request).DESCRIPTOR.fields_by_name
