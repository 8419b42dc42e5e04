"""The scheduler side's link to the node's leader.

Runs on the engine's scheduler thread, so every call is short and bounded: a leader that is
down costs one failed attempt per ``retry_s`` (then the engine runs without hits), never a
hang or a crash. :class:`LeaderPort` is the seam the scheduler core depends on (tests give
it a fake leader).
"""
from __future__ import annotations

import logging
from typing import Protocol, Sequence

from ...handles import TransferHandle
from ...errors import KvbmError, KvbmUnavailableError
from ...ids import BlockHash
from ...leader_session import LeaderSession
from .settings import Backoff, ConnectorSettings

log = logging.getLogger("kvbm.connector")


class LeaderPort(Protocol):
    """What the scheduler core asks of the leader. None: the leader is not reachable now."""

    def prepare_load(self, hashes: Sequence[BlockHash], count_hit: bool = False,
                     tokens_per_block: int = 0, prefill_tokens_per_s: float = 0.0) -> TransferHandle | None: ...

    def prepare_store(self, hashes: Sequence[BlockHash]) -> TransferHandle | None: ...

    def release(self, handle: TransferHandle) -> None: ...

    def may_hold(self, key: BlockHash) -> bool:
        """False only when the leader's presence filter rules ``key`` out (see
        :mod:`kvbm_client.presence`): a lookup starting at it would match nothing."""
        ...

    def unasked(self, blocks: int) -> None:
        """A lookup of ``blocks`` blocks was answered as a miss on :meth:`may_hold`'s word."""
        ...

    def close(self) -> None: ...


class LeaderLink:
    """A :class:`~kvbm_client.leader_session.LeaderSession` opened on first use and again
    after it failed, at most once per ``retry_s``. Every failure is logged and answered None.

    Owns the session; invariant: ``_session`` is None or open.
    """

    def __init__(self, settings: ConnectorSettings, client_name: str = "kvbm-scheduler") -> None:
        self._settings = settings
        self._client_name = client_name
        self._session: LeaderSession | None = None
        self._backoff = Backoff(settings.retry_s)

    def prepare_load(self, hashes: Sequence[BlockHash], count_hit: bool = False,
                     tokens_per_block: int = 0, prefill_tokens_per_s: float = 0.0) -> TransferHandle | None:
        session = self._connected()
        if session is None:
            return None
        try:
            return session.prepare_load(hashes, count_hit=count_hit, tokens_per_block=tokens_per_block,
                                        prefill_tokens_per_s=prefill_tokens_per_s)
        except KvbmError as exc:
            self._failed("prepare_load", exc)
            return None

    def prepare_store(self, hashes: Sequence[BlockHash]) -> TransferHandle | None:
        session = self._connected()
        if session is None:
            return None
        try:
            return session.prepare_store(hashes)
        except KvbmError as exc:
            self._failed("prepare_store", exc)
            return None

    def release(self, handle: TransferHandle) -> None:
        session = self._connected()
        if session is None:
            return
        try:
            session.release(handle)
        except KvbmError as exc:
            self._failed("release", exc)

    def may_hold(self, key: BlockHash) -> bool:
        if not self._settings.presence_filter:
            return True
        session = self._connected()
        return session is None or session.may_hold(key)  # (no session: prepare_load answers None)

    def unasked(self, blocks: int) -> None:
        if self._session is not None:
            self._session.unasked(blocks)

    def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                session.close()
            except Exception:  # best effort: the leader expires the session anyway
                pass

    def _connected(self) -> LeaderSession | None:
        if self._session is not None or not self._backoff.ready():
            return self._session
        s = self._settings
        try:
            self._session = LeaderSession(s.leader_address, client_name=self._client_name, timeout=s.timeout_s,
                                          config=s.config)
            log.info("kvbm connector: connected to leader %s", s.leader_address)
            self._backoff.reset()
        except (KvbmError, OSError) as exc:
            log.warning("kvbm leader %s unreachable (%s); serving without kvbm hits, retrying in %gs",
                        s.leader_address, exc, s.retry_s)
            self._backoff.failed()
        return self._session

    def _failed(self, what: str, exc: KvbmError) -> None:
        log.warning("kvbm %s failed: %s", what, exc)
        self._backoff.failed()
        if isinstance(exc, KvbmUnavailableError):
            self.close()
