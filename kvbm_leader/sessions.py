"""Client sessions: the lease under which a connector holds pins and pending jobs.

Runs in the leader; pure and synchronous (the caller passes the clock). A session that is
not renewed within its TTL expires; the leader then rolls back its jobs (releasing pins), so
a client that dies never leaves blocks pinned.

Limits (:class:`SessionLimits`, from ``DYN_KVBM_MAX_SESSIONS``, ``_MAX_SESSION_TTL_SECS`` and
``_MAX_NAME_BYTES``): at most ``max_sessions`` open sessions (``OpenSession`` beyond is
refused, nothing changes), a TTL asked for is clamped to ``max_ttl`` (the answer says the TTL
granted), a client name longer than ``max_name_bytes`` is refused.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvbm_client.ids import SessionId

from .refusals import Refused, Why


@dataclass(slots=True)
class Session:
    session_id: SessionId
    client_name: str
    ttl: float
    renewed_at: float

    def expired(self, now: float) -> bool:
        return now - self.renewed_at > self.ttl


@dataclass(frozen=True, slots=True)
class SessionLimits:
    default_ttl: float = 10.0
    max_ttl: float = 120.0
    max_sessions: int = 1024
    max_name_bytes: int = 256


class SessionTable:
    """Open sessions by id; see the module docstring for the limits :meth:`admit` applies."""

    def __init__(self, limits: SessionLimits | None = None) -> None:
        self.limits = limits or SessionLimits()
        self._sessions: dict[SessionId, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def admit(self, client_name: str, ttl_ms: int, now: float) -> Session:
        """Open a session under the limits: ``ttl_ms`` 0 means the default TTL, a longer one
        than allowed is clamped. Raises :class:`Refused` (nothing changes)."""
        lim = self.limits
        if len(client_name.encode()) > lim.max_name_bytes:
            raise Refused(Why.INVALID, f"client_name of {len(client_name.encode())} bytes; at most "
                                       f"{lim.max_name_bytes} (DYN_KVBM_MAX_NAME_BYTES)")
        if len(self._sessions) >= lim.max_sessions:
            raise Refused(Why.EXHAUSTED, f"{len(self._sessions)} sessions are open; at most {lim.max_sessions} "
                                         "(DYN_KVBM_MAX_SESSIONS)")
        ttl = min(ttl_ms / 1000 if ttl_ms else lim.default_ttl, lim.max_ttl)
        return self.open(client_name or "anonymous", ttl, now)

    def open(self, client_name: str, ttl: float, now: float) -> Session:
        session = Session(SessionId(uuid.uuid4().hex), client_name, ttl, now)
        self._sessions[session.session_id] = session
        return session

    def renew(self, session_id: SessionId, now: float) -> bool:
        session = self._sessions.get(session_id)
        if session is None:
            return False
        session.renewed_at = now
        return True

    def require(self, session_id: SessionId, now: float) -> SessionId:
        """Renew ``session_id`` or refuse the request (unknown or expired session)."""
        if not self.renew(session_id, now):
            raise Refused(Why.UNKNOWN, f"unknown or expired session {session_id!r}; open a new one")
        return session_id

    def get(self, session_id: SessionId) -> Session | None:
        return self._sessions.get(session_id)

    def close(self, session_id: SessionId) -> Session | None:
        return self._sessions.pop(session_id, None)

    def pop_expired(self, now: float) -> list[Session]:
        gone = [s for s in self._sessions.values() if s.expired(now)]
        for s in gone:
            del self._sessions[s.session_id]
        return gone
