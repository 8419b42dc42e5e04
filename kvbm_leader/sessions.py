"""Client sessions: the lease under which a connector holds pins and pending jobs.

Runs in the leader; pure and synchronous (the caller passes the clock). A session that is
not renewed within its TTL expires; the daemon then rolls back its jobs (releasing pins), so
a client that dies never leaves blocks pinned.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvbm_client.ids import SessionId


@dataclass(slots=True)
class Session:
    session_id: SessionId
    client_name: str
    ttl: float
    renewed_at: float

    def expired(self, now: float) -> bool:
        return now - self.renewed_at > self.ttl


class SessionTable:
    def __init__(self) -> None:
        self._sessions: dict[SessionId, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

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

    def get(self, session_id: SessionId) -> Session | None:
        return self._sessions.get(session_id)

    def close(self, session_id: SessionId) -> Session | None:
        return self._sessions.pop(session_id, None)

    def pop_expired(self, now: float) -> list[Session]:
        gone = [s for s in self._sessions.values() if s.expired(now)]
        for s in gone:
            del self._sessions[s.session_id]
        return gone
