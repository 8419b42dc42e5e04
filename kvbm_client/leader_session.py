"""A leader session on gRPC's blocking stack, for an engine's scheduler thread.

A connector's scheduler role calls the leader a few times per engine step, on the engine's
own thread. Each call here is one blocking RPC on the caller's thread: no event loop, no
hand-off to another thread and back (:class:`~kvbm_client.client.KvbmClient` runs the
asyncio client on a private loop thread, which costs two thread wake-ups per call). A daemon
thread renews the session; the pins of a session that stops renewing (the engine died)
expire at the leader after its TTL.

The engine process then uses only gRPC's synchronous stack (the worker role's channel is
synchronous too), so nothing in it depends on an asyncio loop surviving vLLM's process
model (fork, worker threads).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from .channels import open_channel
from .handles import TransferHandle, load_handle, store_handle
from .config import KvbmConfig
from .contract import pb, rpc
from .errors import KvbmError, from_rpc_error
from .ids import BlockHash, SessionId, WorkerId
from .presence import PresenceView
from .session import SessionCore

log = logging.getLogger("kvbm.client")


@dataclass(frozen=True, slots=True)
class StageAsk:
    """A lookup's request to stage the load it plans (``PrepareLoadRequest.stage``): the
    leader sends the signed plan to each named worker before it answers, and each copies the
    load's first of ``layer_groups`` groups into its staging area (``kvbm-worker --stage-mib``)."""

    layer_groups: int
    targets: tuple[tuple[WorkerId, str], ...]  # (worker, the engine's region id on it)

    def wire(self) -> "pb.LoadStage":
        return pb.LoadStage(layer_groups=self.layer_groups,
                            targets=[pb.StageTarget(worker_id=w, region_id=r) for w, r in self.targets])


class LeaderSession:
    """``prepare_load`` / ``prepare_store`` / ``release`` against one leader, synchronously:
    the blocking shell of a :class:`~kvbm_client.session.SessionCore`.

    Raises :class:`~kvbm_client.errors.KvbmError` subclasses (``KvbmUnavailableError`` when
    the leader cannot be reached within ``timeout``).
    """

    def __init__(self, address: str, client_name: str = "kvbm-scheduler", timeout: float = 2.0,
                 config: KvbmConfig | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._session = SessionCore(client_name)
        self._channel = open_channel(address, config or KvbmConfig.from_env())
        self._stub: Any = rpc.LeaderStub(self._channel)  # the generated stubs are untyped
        self._stop = threading.Event()
        #: the leader's presence filter, mapped (None: none, or not readable here); when the
        #: session re-opens with another leader, replaced and the old mapping closed (a reader
        #: on another thread that still holds it gets "maybe": see PresenceView.may_hold)
        self._presence: PresenceView | None = None
        self._presence_from = ""  # the path it was mapped from
        #: blocks of lookups answered as misses by the filter, not told to the leader yet
        self._unasked = 0
        try:
            self._open(wait_for_ready=True)
        except KvbmError:
            self._channel.close()
            raise
        self._renewer = threading.Thread(target=self._renew, name="kvbm-session", daemon=True)
        self._renewer.start()

    @property
    def session_id(self) -> SessionId:
        return self._session.session_id

    @property
    def ttl_s(self) -> float:
        return self._session.ttl_s

    # ------------------------------------------------------------------ session
    def _open(self, wait_for_ready: bool = False) -> None:
        try:
            resp = self._stub.OpenSession(self._session.open_request(), timeout=self.timeout,
                                          wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise self._session.open_error(exc, self.address, self.timeout) from None
        self._session.opened(resp)
        if self._session.presence_path != self._presence_from:
            self._presence_from = self._session.presence_path
            old, self._presence = self._presence, PresenceView.open(
                self._presence_from, self._session.presence_slots, self._session.leader_id)
            if old is not None:
                old.close()  # (the old leader's file is unlinked: the mapping alone kept its pages)

    def _renew(self) -> None:
        core = self._session
        failing = False  # NOTE: the first failure of a streak is a warning (the pins expire at the TTL)
        while not self._stop.wait(core.renew_every_s):
            try:
                self._stub.KeepAlive(core.keepalive_request(), timeout=core.renew_every_s)
                failing = False
            except grpc.RpcError as exc:
                if not core.reopen_after(exc):
                    (log.debug if failing else log.warning)("kvbm keepalive of session %s failed: %s %s",
                                                            core.session_id, exc.code().name, exc.details())
                    failing = True
                    continue
                try:
                    self._open()
                    log.warning("kvbm session re-opened at %s", self.address)
                except KvbmError as reopen:
                    log.debug("kvbm session re-open failed: %s", reopen)

    def _call(self, name: str, request: Any) -> Any:
        for attempt in (0, 1):
            self._session.stamp(request)
            try:
                return getattr(self._stub, name)(request, timeout=self.timeout)
            except grpc.RpcError as exc:
                if self._session.retry_after(exc, attempt, request):  # the leader restarted: new session, once
                    self._open()
                    continue
                raise from_rpc_error(exc, f"leader {name}") from None
        raise AssertionError("unreachable: the second attempt returns or raises")

    # ------------------------------------------------------------------ presence
    def may_hold(self, key: BlockHash) -> bool:
        """False only when the leader's presence filter rules ``key`` out: a lookup starting at
        it would match nothing (True without a filter)."""
        view = self._presence
        return view is None or view.may_hold(key)

    def unasked(self, blocks: int) -> None:
        """A lookup of ``blocks`` blocks was answered as a miss because :meth:`may_hold` said
        False; the next ``PrepareLoad`` or ``PrepareStore`` tells the leader (its hit rates)."""
        self._unasked += blocks

    def _telling(self, name: str, request: Any) -> Any:
        """``_call`` with the blocks :meth:`unasked` gathered put in ``request``; they are kept
        for the next call if this one fails."""
        told = request.unasked_blocks = min(self._unasked, 0xFFFFFFFF)
        self._unasked -= told
        try:
            return self._call(name, request)
        except KvbmError:
            self._unasked += told
            raise

    # ------------------------------------------------------------------ calls
    def prepare_load(self, hashes: Sequence[BlockHash], count_hit: bool = False,
                     tokens_per_block: int = 0, prefill_tokens_per_s: float = 0.0,
                     stage: StageAsk | None = None) -> TransferHandle:
        """Plan and pin the longest stored prefix of ``hashes`` (``count_hit``: also count the
        lookup; ``prefill_tokens_per_s`` > 0: only as far as loading beats recomputing;
        ``stage``: the leader stages the plan on those workers before it answers)."""
        request = pb.PrepareLoadRequest(hashes=list(hashes), count_hit=count_hit, tokens_per_block=tokens_per_block,
                                        prefill_tokens_per_s=prefill_tokens_per_s)
        if stage is not None:
            request.stage.CopyFrom(stage.wire())
        return load_handle(self._telling("PrepareLoad", request))

    def prepare_store(self, hashes: Sequence[BlockHash]) -> TransferHandle:
        """Plan slots for the entries of ``hashes`` not stored yet (``indices``: which)."""
        resp = self._telling("PrepareStore", pb.PrepareStoreRequest(hashes=list(hashes)))
        return store_handle(resp)

    def release(self, handle: TransferHandle) -> None:
        """Give back a prepared job that will not be started (unpins a load)."""
        if handle.is_empty:
            return
        self._call("Release", pb.ReleaseRequest(job_id=handle.job_id))

    def close(self) -> None:
        """Close the session (the leader drops its pins) and the channel; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._stub.CloseSession(self._session.close_request(), timeout=2)
        except grpc.RpcError:
            pass
        self._channel.close()
        if self._presence is not None:
            self._presence.close()

    def __enter__(self) -> "LeaderSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
