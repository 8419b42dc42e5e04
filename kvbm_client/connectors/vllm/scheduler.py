"""Scheduler role of the vLLM connector: talks to the node's leader.

Runs in vLLM's EngineCore process, on the scheduler's thread, so every call here is short
and bounded: a leader that is down costs one failed call per ``retry_s`` (then the engine
runs without hits), never a hang or a crash.

Per step: at most one ``PrepareLoad`` per new request (it matches, counts the hit and pins
the blocks in one round trip) and one ``PrepareStore`` for all blocks completed in the step.
The calls are blocking RPCs on the scheduler's own thread (:class:`LeaderSession`).

Loads are synchronous by default (``load_mode``): the hit's tokens count as computed at
once, the worker role copies them in before the step's forward, and the request is prefilled
in the same step. ``load_mode: "async"`` parks the request in ``WAITING_FOR_REMOTE_KVS``
until the worker role reports the load done, so other requests' steps never wait for a copy.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ...client import TransferHandle
from ...errors import KvbmError, KvbmUnavailableError
from ...ids import BlockHash
from ...leader_session import LeaderSession
from .early_loads import EarlyLoads
from .metadata import KvbmConnectorMetadata, LoadSpec, StoreSpec
from .settings import Backoff, ConnectorSettings
from .worker import TRACE, trace

log = logging.getLogger("kvbm.connector")


@dataclass
class RequestState:
    """What the scheduler role remembers of one request."""

    request: Any
    keys: list[BlockHash] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_stored: int = 0  # leading blocks already offloaded (or known to be in kvbm)
    load: TransferHandle | None = None
    load_first_block: int = 0
    load_sent: bool = False
    has_stores: bool = False
    miss_at: tuple[int, int] | None = None  # (computed, tokens) of the last lookup that missed


class KvbmConnectorScheduler:
    def __init__(self, block_size: int, settings: ConnectorSettings, worker_ids: list[str] | None = None) -> None:
        self.block_size = block_size
        self.settings = settings
        self._early = EarlyLoads(settings, worker_ids) if settings.early_loads and worker_ids else None
        self._ns = settings.namespace.encode()
        self._client: LeaderSession | None = None
        self._backoff = Backoff(settings.retry_s)
        self._reqs: dict[str, RequestState] = {}
        self._loads: list[LoadSpec] = []
        self._delayed: list[str] = []

    # ------------------------------------------------------------------ leader link
    def _leader(self) -> LeaderSession | None:
        if self._client is not None:
            return self._client
        if not self._backoff.ready():
            return None
        try:
            self._client = LeaderSession(self.settings.leader_address, client_name="vllm-scheduler",
                                         timeout=self.settings.timeout_s, config=self.settings.config)
            log.info("kvbm connector: connected to leader %s", self.settings.leader_address)
            self._backoff.reset()
        except (KvbmError, OSError) as exc:
            log.warning("kvbm leader %s unreachable (%s); serving without kvbm hits, retrying in %gs",
                        self.settings.leader_address, exc, self.settings.retry_s)
            self._backoff.failed()
        return self._client

    def _call(self, name: str, *args, **kwargs):
        client = self._leader()
        if client is None:
            return None
        try:
            return getattr(client, name)(*args, **kwargs)
        except KvbmError as exc:
            log.warning("kvbm %s failed: %s", name, exc)
            self._backoff.failed()
            if isinstance(exc, KvbmUnavailableError):
                self._drop_client()
            return None

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    # ------------------------------------------------------------------ keys
    def _keys(self, state: RequestState) -> list[BlockHash]:
        """kvbm keys of the request's full blocks: vLLM's own block hashes (which carry
        cache_salt and LoRA) namespaced by model, so two models never share a key."""
        hashes = state.request.block_hashes
        for h in hashes[len(state.keys):]:
            state.keys.append(BlockHash(hashlib.blake2b(self._ns + bytes(h), digest_size=16).digest()))
        return state.keys

    def _state(self, request) -> RequestState:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = RequestState(request)
        return state

    # ------------------------------------------------------------------ vLLM hooks
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._state(request)
        sync = self.settings.sync_loads
        if state.load is not None and not state.load_sent:
            return state.load.num_blocks * self.block_size, not sync  # asked again: same answer
        if state.miss_at == (num_computed_tokens, request.num_tokens):
            return 0, False  # asked again while the request waits for G1 space: same miss
        keys = self._keys(state)
        first = num_computed_tokens // self.block_size
        # Leave at least one prompt token to compute: vLLM's CPU kernels crash (SIGILL) on a
        # request whose whole prompt arrives from a connector.
        last = min(len(keys), (request.num_tokens - 1) // self.block_size)
        if first >= last or state.load_sent:
            return 0, False
        t0 = time.perf_counter()
        handle = self._call("prepare_load", keys[first:last], count_hit=True, tokens_per_block=self.block_size)
        if TRACE:
            trace("prepare_load", req=request.request_id, asked=last - first,
                  planned=handle.num_blocks if handle is not None else 0,
                  ms=round((time.perf_counter() - t0) * 1e3, 2))
        if handle is None or handle.is_empty:
            if handle is not None:
                state.miss_at = (num_computed_tokens, request.num_tokens)
            return 0, False
        state.load, state.load_first_block = handle, first
        log.debug("kvbm hit %s: %d blocks after %d local (%s load)", request.request_id, handle.num_blocks, first,
                  self.settings.load_mode)
        return handle.num_blocks * self.block_size, not sync

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is None or state.load is None or state.load_sent:
            return
        if num_external_tokens == 0:
            self._release(state)
            return
        n = num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0]
        first = state.load_first_block
        signed = state.load.signed
        spec = LoadSpec(request.request_id, signed.plan, signed.signature, list(block_ids[first:first + n]),
                        sync=self.settings.sync_loads)
        self._loads.append(spec)
        state.load_sent = True
        if self._early is not None:
            sent = self._early.submit(spec)
            if TRACE:
                trace("early_load", req=request.request_id, blocks=n, workers=sent)
        state.num_stored = max(state.num_stored, first + n)

    def _release(self, state: RequestState) -> None:
        if state.load is not None and not state.load_sent:
            self._call("release", state.load)
        state.load = None

    def build_connector_meta(self, scheduler_output) -> KvbmConnectorMetadata:
        meta = KvbmConnectorMetadata(loads=self._loads, delayed_frees=self._delayed)
        self._loads, self._delayed = [], []
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        meta.fence = any(self._reqs[r].has_stores for r in preempted if r in self._reqs)
        self._track_blocks(scheduler_output)
        keys: list[BlockHash] = []
        blocks: list[int] = []
        owners: list[str] = []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = self._reqs.get(req_id)
            if state is None:
                continue
            computed = state.request.num_computed_tokens + num_new
            full = min(len(self._keys(state)), computed // self.block_size, len(state.block_ids))
            for i in range(state.num_stored, full):
                keys.append(state.keys[i])
                blocks.append(state.block_ids[i])
                owners.append(req_id)
            state.num_stored = max(state.num_stored, full)
        if TRACE and (meta.loads or keys):
            trace("step", loads=[(x.req_id, len(x.engine_blocks), x.sync) for x in meta.loads], store_keys=len(keys))
        if keys:
            t0 = time.perf_counter()
            handle = self._call("prepare_store", keys)
            if TRACE:
                trace("prepare_store", keys=len(keys), ms=round((time.perf_counter() - t0) * 1e3, 2))
            if handle is not None and not handle.is_empty:
                picked = [owners[i] for i in handle.indices]
                for req_id in set(picked):
                    self._reqs[req_id].has_stores = True
                meta.stores.append(StoreSpec(handle.signed.plan, handle.signed.signature,
                                             [blocks[i] for i in handle.indices], picked))
        return meta

    def _track_blocks(self, so) -> None:
        for new in so.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
        cached = so.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            new_ids = cached.new_block_ids[i]
            if state is None or new_ids is None:
                continue
            if req_id in resumed:
                state.block_ids = list(new_ids[0])
            else:
                state.block_ids.extend(new_ids[0])

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        if TRACE:
            trace("finished", req=request.request_id)
        state = self._reqs.pop(request.request_id, None)
        if state is None:
            return False, None
        self._release(state)
        if state.has_stores:
            # Keep the blocks until the worker role confirms its stores read them.
            self._delayed.append(request.request_id)
            return True, None
        return False, None

    def shutdown(self) -> None:
        self._drop_client()
        if self._early is not None:
            self._early.close()
