"""The scheduler side's link to the node's leader.

Runs on the engine's scheduler thread, so every call is short and bounded, and a leader that is
down or hung never stalls the engine: the engine runs without hits (lookups are misses, stores
are skipped) until the leader answers again, never a hang or a crash.

* Every attempt to open a session runs on the link's own thread. The first starts when the
  link is made (an engine makes it at start-up, long before its first request); a call made
  while that one is on its way waits for it (at most ``timeout_s``: a request right after
  start-up still gets its hits). Every later attempt (after one failed, or after the session was
  lost) starts at most once per ``retry_s``, and the calls meanwhile answer None at once; the
  first call after an attempt succeeded uses the new session.
* After a call failed (a leader that did not answer within ``timeout_s``), the calls answer None
  for ``retry_s`` before the next one is tried: a hung leader costs one timeout per ``retry_s``,
  not one per call.

Before 2026-11-27 (twenty-third session) every attempt ran on the caller's thread: with no node
running, each engine step that reached the leader waited up to ``timeout_s`` per link, every
``retry_s`` (4 s per request in ``test_engine_serves_without_kvbm_running``).

:class:`LeaderPort` is the seam the scheduler core depends on (tests give it a fake leader).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Protocol, Sequence

from ...handles import TransferHandle
from ...errors import KvbmError, KvbmTimeoutError, KvbmUnavailableError
from ...ids import BlockHash
from ...leader_session import LeaderSession, StageAsk
from .settings import Backoff, ConnectorSettings

log = logging.getLogger("kvbm.connector")


class LeaderPort(Protocol):
    """What the scheduler core asks of the leader. None: the leader is not reachable now."""

    def prepare_load(self, hashes: Sequence[BlockHash], count_hit: bool = False,
                     tokens_per_block: int = 0, prefill_tokens_per_s: float = 0.0,
                     stage: StageAsk | None = None) -> TransferHandle | None: ...

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
    """A :class:`~kvbm_client.leader_session.LeaderSession` opened in the background from the
    start and, after it failed or was lost, again, at most once per ``retry_s``. Every failure is
    logged and answered None.

    Used from one thread (its owner: the scheduler's, or the store planner's); owns the session
    and one thread that opens sessions. Invariants: ``_session`` is None or open; at most one
    attempt is in flight (``_attempt``), and its session is adopted on the owner's thread (or
    closed, if the link closed first); only the first attempt is ever waited for.
    """

    def __init__(self, settings: ConnectorSettings, client_name: str = "kvbm-scheduler") -> None:
        self._settings = settings
        self._client_name = client_name
        self._session: LeaderSession | None = None
        self._backoff = Backoff(settings.retry_s)
        self._opener = ThreadPoolExecutor(1, thread_name_prefix=f"{client_name}-connect")
        self._attempt: Future[LeaderSession | None] | None = self._opener.submit(self._open)
        self._first = True  # the attempt in flight is the first (a call waits for it)
        self._closed = False

    def prepare_load(self, hashes: Sequence[BlockHash], count_hit: bool = False,
                     tokens_per_block: int = 0, prefill_tokens_per_s: float = 0.0,
                     stage: StageAsk | None = None) -> TransferHandle | None:
        session = self._connected()
        if session is None:
            return None
        try:
            return session.prepare_load(hashes, count_hit=count_hit, tokens_per_block=tokens_per_block,
                                        prefill_tokens_per_s=prefill_tokens_per_s, stage=stage)
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
            return  # (the plan's pins expire at the leader)
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
        self._closed = True
        self._drop_session()
        attempt, self._attempt = self._attempt, None
        if attempt is not None:
            attempt.add_done_callback(_close_opened)  # (an attempt still on its way closes what it opened)
        self._opener.shutdown(wait=False)

    def _connected(self) -> LeaderSession | None:
        """The open session, or None: none now (an attempt is made or started if the backoff
        allows) or a call failed less than ``retry_s`` ago."""
        attempt = self._attempt
        if attempt is not None:
            if self._first:
                self._first = False
                wait([attempt], timeout=self._settings.timeout_s + 1.0)  # (the attempt is bounded by timeout_s)
            if not attempt.done():
                return None
            self._attempt = None
            self._adopt(attempt.result())
        if not self._backoff.ready():
            return None
        if self._session is None and not self._closed:
            self._attempt = self._opener.submit(self._open)
        return self._session

    def _open(self) -> LeaderSession | None:
        """One attempt to open a session (on the link's own thread)."""
        s = self._settings
        try:
            return LeaderSession(s.leader_address, client_name=self._client_name, timeout=s.timeout_s,
                                 config=s.config)
        except (KvbmError, OSError) as exc:
            log.warning("kvbm leader %s unreachable (%s); serving without kvbm hits, retrying in %gs",
                        s.leader_address, exc, s.retry_s)
            return None

    def _adopt(self, session: LeaderSession | None) -> None:
        if session is None:
            self._backoff.failed()
            return
        self._session = session
        self._backoff.reset()
        log.info("kvbm connector: connected to leader %s", self._settings.leader_address)

    def _failed(self, what: str, exc: KvbmError) -> None:
        """A call failed: the leader did not answer (timeout, unreachable: back off, and a lost
        session is dropped, to be opened again in the background) or refused this request (the
        link stays in use)."""
        if not isinstance(exc, (KvbmTimeoutError, KvbmUnavailableError)):
            log.warning("kvbm %s failed: %s", what, exc)
            return
        log.warning("kvbm %s failed: %s; serving without kvbm hits for %gs", what, exc, self._settings.retry_s)
        self._backoff.failed()
        if isinstance(exc, KvbmUnavailableError):
            self._drop_session()

    def _drop_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            _close_quietly(session)


def _close_quietly(session: LeaderSession) -> None:
    try:
        session.close()
    except Exception:  # best effort: the leader expires the session anyway
        pass


def _close_opened(attempt: "Future[LeaderSession | None]") -> None:
    session = attempt.result() if not attempt.cancelled() else None
    if session is not None:
        _close_quietly(session)
