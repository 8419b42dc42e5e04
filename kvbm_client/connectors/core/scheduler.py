"""The engine-independent scheduler side of a kvbm connector: what to load, store and keep.

Runs on the engine's scheduler thread (one per engine: vLLM's EngineCore, TensorRT-LLM's
rank 0). Speaks in request ids, token ids, kvbm block keys and engine block ids; an engine
adapter translates its hooks into these calls, in this order per request:

1. :meth:`SchedulerCore.lookup` (vLLM ``get_num_new_matched_tokens``): at most one pinned
   ``PrepareLoad`` per request, answered again without a round trip while still valid, a miss
   without one when the presence filter rules the prefix out; returns ``(tokens to load,
   asynchronous)`` (:mod:`.lookup`).
2. :meth:`SchedulerCore.allocated` (``update_state_after_alloc``): the engine gave the
   request its blocks; the load is planned into them, or released when the engine took no
   external tokens.
3. :meth:`SchedulerCore.assign_blocks` then :meth:`SchedulerCore.step`
   (``build_connector_meta``): every block that this step completes (by the tokens computed
   once its forward ran) is offloaded, one ``PrepareStore`` for all requests of the step;
   returns the :class:`StepPlan` to send to the workers (loads, stores, delayed frees, fence).
   With a :class:`~.store_planner.StorePlanner` the ``PrepareStore`` runs on its thread while
   the step runs, and its stores ship with the next step (``earlier_stores``), for a step with
   at least ``StorePlanner.min_keys`` new blocks, or any that loads nothing where the planner
   takes those (``StorePlanner.takes``; a smaller step is answered here: its round trip is
   short, and hidden behind a load's copy); a request counts as having stores from the moment
   they are asked for.
   The step's loads are started early on the worker daemons here, unless this step or one
   still in flight (``overlapping_steps``) fences: a block the engine took back from a
   preempted request may be the destination of a load while a store still reads it, and only
   the worker side's fence orders the two (with overlapping steps, a step is scheduled while
   the worker side of the one before may still be waiting at its fence). An engine that
   schedules a step before the previous one ran must pass ``early`` only if it also keeps a
   freed block from being reallocated while a step in flight may still write it (vLLM's
   deferred block frees).
4. :meth:`SchedulerCore.finished` (``request_finished``): True when the request's blocks
   must stay allocated until its stores are done (the worker side reports it). With
   :attr:`SchedulerCore.holds` (an engine pool that pins blocks, :mod:`.block_holds`) never:
   each store's blocks are pinned from the moment it is asked for until every worker side
   reported it settled (:meth:`SchedulerCore.stores_settled`), and the rest is freed at once.

Failures never fail the engine: a leader that is down turns lookups into misses and
stores into skips (see :mod:`.leader_link`).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Iterable, Mapping, Sequence

from ...ids import BlockHash, EngineBlockId
from ...leader_session import StageAsk
from .block_holds import BlockHolds
from .early_loads import EarlyLoads
from .leader_link import LeaderPort
from .lookup import HitLookup
from .prefill import PrefillMeter
from .request_keys import EngineRequest, ExtrasOf, KeyHasher, RequestState, Span
from .settings import ConnectorSettings
from .specs import LoadSpec, RequestId, StepPlan, StoreSpec
from .store_planner import StorePlanner, store_spec
from .tracing import trace, tracing

log = logging.getLogger("kvbm.connector")


class SchedulerCore:
    """Owns the per-request states and the step's pending loads and delayed frees.

    Invariants: a request's load is planned at most once (``load_sent``); a pinned load that
    the engine does not take is released; blocks are offloaded in order, each once
    (``num_stored``); a request with stores is reported in ``delayed_frees`` when it ends,
    unless :attr:`holds` pins every block a store may still read (from the ask on).
    """

    def __init__(self, block_size: int, settings: ConnectorSettings, leader: LeaderPort, extras_of: ExtrasOf,
                 early: EarlyLoads | None = None, overlapping_steps: int = 1,
                 store_planner: StorePlanner | None = None) -> None:
        self.block_size = block_size
        self.settings = settings
        self._leader = leader
        self._extras_of = extras_of
        self._early = early
        #: stage each new hit at its lookup, on the workers with a staging area (``staged_loads``:
        #: early loads in layer groups)
        self._stages = early is not None and settings.staged_loads and settings.load_layer_groups > 1
        if settings.staged_loads and not self._stages:
            log.debug("kvbm: staged_loads is on, but hits are not staged: they need early loads and load_mode "
                     "layerwise (with layer_groups > 1)")
        #: plans each step's stores off this thread; they ship with the next step (None: each
        #: step's ``PrepareStore`` is answered here and its stores ship with it)
        self._planner = store_planner
        #: whether each of the last ``overlapping_steps`` steps (this one last) fenced
        self._fences: deque[bool] = deque(maxlen=max(1, overlapping_steps))
        self._reqs: dict[RequestId, RequestState] = {}
        self._loads: list[LoadSpec] = []
        self._delayed: list[RequestId] = []
        #: the engine's prefill speed, sent with each lookup (see :mod:`.prefill`)
        self.prefill = PrefillMeter(settings.prefill_tokens_per_s)
        #: the requests' block keys, hashed on this thread and on the store planner's
        self.hasher = KeyHasher()
        self._lookup = HitLookup(block_size, settings, leader, self.hasher, self.prefill)
        #: the blocks stores read, pinned in the engine's pool (None: delayed frees instead);
        #: set by the adapter before the first step
        self.holds: BlockHolds | None = None
        self._asked_hold = 0  # the hold of the store plan on the planner's thread (0: none)

    # ------------------------------------------------------------------ requests
    def request(self, req_id: str) -> EngineRequest | None:
        """The engine's request object the core tracks under ``req_id`` (from its first lookup
        to its end), or None."""
        state = self._reqs.get(RequestId(req_id))
        return state.request if state is not None else None

    def _track(self, request: EngineRequest) -> RequestState:
        req_id = RequestId(request.request_id)
        state = self._reqs.get(req_id)
        if state is None:
            extras = self._extras_of(request)
            identity = None if extras is None else self.hasher.identity(self.settings.namespace, self.block_size, extras)
            state = self._reqs[req_id] = RequestState(request, identity)
        return state

    # ------------------------------------------------------------------ 1. lookup
    def lookup(self, request: EngineRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens kvbm loads after the engine's ``num_computed_tokens`` local ones, and
        whether the load is asynchronous (the request then waits for it): see :mod:`.lookup`.
        With ``staged_loads`` the lookup asks the leader to stage a new hit on the worker daemons
        (it sends them the plan before it answers)."""
        state = self._track(request)
        held = state.load
        stage = None
        if self._stages:
            assert self._early is not None
            targets = self._early.stage_targets()
            stage = StageAsk(self.settings.load_layer_groups, targets) if targets else None
        answer = self._lookup.ask(state, num_computed_tokens, stage)
        if stage is not None and state.load is not None and state.load is not held and tracing():
            trace("stage", req=request.request_id, blocks=state.load.num_blocks, workers=len(stage.targets))
        return answer

    # ------------------------------------------------------------------ 2. allocation
    def pending_load(self, req_id: str) -> bool:
        """A hit is pinned for the request and not planned into its blocks yet."""
        state = self._reqs.get(RequestId(req_id))
        return state is not None and state.load is not None and not state.load_sent

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int | None = None) -> None:
        """The engine allocated the request's blocks (``block_ids``: all of them, in token
        order, the engine's own prefix included) and takes ``num_external_tokens`` from kvbm
        (None: what :meth:`lookup` answered): plan the load into them."""
        state = self._reqs.get(RequestId(req_id))
        if state is None or state.load is None or state.load_sent:
            return
        if num_external_tokens is None:
            num_external_tokens = state.load.num_blocks * self.block_size
        if num_external_tokens == 0:
            self._lookup.release(state)
            return
        n = num_external_tokens // self.block_size
        first = state.load_first_block
        signed = state.load.signed
        assert signed is not None, "a non-empty load handle carries its signed plan"
        spec = LoadSpec(RequestId(req_id), signed.plan, signed.signature,
                        [EngineBlockId(b) for b in block_ids[first:first + n]], sync=self.settings.sync_loads,
                        deadline=state.load.deadline, layer_groups=self.settings.load_layer_groups)
        self._loads.append(spec)
        state.load_sent = True
        state.num_stored = max(state.num_stored, first + n)
        if tracing():
            trace("allocated", req=req_id, blocks=n)

    # ------------------------------------------------------------------ 3. step
    def assign_blocks(self, req_id: str, block_ids: Iterable[int], replace: bool) -> None:
        """The engine's block table of a request grew (``replace``: was rebuilt, e.g. when a
        preempted request resumed)."""
        state = self._reqs.get(RequestId(req_id))
        if state is None:
            return
        ids = [EngineBlockId(b) for b in block_ids]
        if replace:
            state.block_ids = ids
        else:
            state.block_ids.extend(ids)

    def step(self, computed: Mapping[str, int], preempted: Iterable[str] = (), num_tokens: int = 0) -> StepPlan:
        """Close a step: ``computed`` maps each request of the step to its tokens whose KV is
        written once the step's forward ran; ``preempted`` lists the requests whose blocks the
        engine took back; ``num_tokens``: the step's scheduled tokens, for the prefill meter
        (an adapter that reports step ends, :meth:`step_done`, passes it)."""
        if num_tokens:
            self.prefill.scheduled(num_tokens, time.monotonic())
        if self.holds is not None:
            self.holds.expire()
        plan = StepPlan(loads=self._loads, delayed_frees=self._delayed)
        self._loads, self._delayed = [], []
        plan.fence = any(s.has_stores for s in map(self._reqs.get, map(RequestId, preempted)) if s is not None)
        self._fences.append(plan.fence)
        if self._early is not None and plan.loads:
            self._start_early(plan.loads)
        spans: list[Span] = []  # (their tokens: the requests' own lists, read on this thread)
        blocks: list[EngineBlockId] = []
        owners: list[RequestId] = []
        for req_id, num_computed in computed.items() if self.settings.store_blocks else ():
            state = self._reqs.get(RequestId(req_id))
            if state is None:
                continue
            full = min(state.hashable_blocks(), num_computed // self.block_size, len(state.block_ids))
            if full > state.num_stored:
                spans.append(Span(state, state.request.all_token_ids, state.num_stored, full))
                blocks += state.block_ids[state.num_stored:full]
                owners += [RequestId(req_id)] * (full - state.num_stored)
                state.num_stored = full
        if tracing():
            trace("step", loads=[(x.req_id, len(x.engine_blocks), x.sync) for x in plan.loads], store_keys=len(blocks),
                  tokens=num_tokens)
        if self._planner is not None and self._planner.pending:
            # the previous step's: sent before this step's forward
            hold, self._asked_hold = self._asked_hold, 0
            spec = self._narrow(hold, self._planner.collect())
            if spec is not None:
                plan.earlier_stores.append(spec)
        if self._planner is not None and self._planner.takes(len(blocks), loading=bool(plan.loads)):
            for req_id in set(owners):
                self._reqs[req_id].has_stores = True  # before the answer: see store_planner
            self._asked_hold = self.holds.hold(blocks) if self.holds is not None else 0  # (before the answer too)
            # hashed on its thread too, from the tokens of those blocks read now (the requests grow
            # on this thread meanwhile)
            snapshot = [span._replace(tokens=span.tokens[:span.end * self.block_size]) for span in spans]
            self._planner.submit(lambda: self.hasher.span_keys(snapshot), blocks, owners)
        elif blocks:
            hold = self.holds.hold(blocks) if self.holds is not None else 0
            keys = self.hasher.span_keys(spans)
            spec = self._store(keys, blocks, owners) if keys is not None else None
            spec = self._narrow(hold, spec)
            if spec is not None:
                plan.stores.append(spec)
        return plan

    def _narrow(self, hold: int, spec: StoreSpec | None) -> StoreSpec | None:
        """Keep the hold of a store's blocks to those the leader planned (``spec``; None: none)."""
        if not hold or self.holds is None:
            return spec
        if spec is None:
            self.holds.narrow(hold, (), 0.0)
        elif self.holds.narrow(hold, spec.engine_blocks, spec.deadline):
            spec.store_id = hold
        return spec

    def _start_early(self, loads: list[LoadSpec]) -> None:
        assert self._early is not None
        if any(self._fences):
            log.debug("kvbm: %d load(s) of this step not started early: %s fenced (the worker side starts them)",
                      len(loads), "this step" if self._fences[-1] else "a step still in flight")
            return
        for spec in loads:
            sent = self._early.submit(spec)
            if tracing():
                trace("early_load", req=spec.req_id, blocks=len(spec.engine_blocks), workers=sent)

    def _store(self, keys: list[BlockHash], blocks: list[EngineBlockId], owners: list[RequestId]) -> StoreSpec | None:
        t0 = time.perf_counter()
        handle = self._leader.prepare_store(keys)
        if tracing():
            trace("prepare_store", keys=len(keys), ms=round((time.perf_counter() - t0) * 1e3, 2))
        spec = store_spec(handle, blocks, owners)
        if spec is not None:
            for req_id in set(spec.req_ids):
                self._reqs[req_id].has_stores = True
        return spec

    def step_done(self) -> None:
        """The oldest scheduled step's output came back (vLLM ``update_connector_output``)."""
        self.prefill.finished(time.monotonic())

    def stores_settled(self, store_ids: Iterable[int]) -> None:
        """Worker sides reported these held stores settled (one id per worker side's report)."""
        if self.holds is not None:
            self.holds.settled(store_ids)

    @property
    def holding(self) -> bool:
        """Blocks are held for stores not reported settled yet (the engine must keep stepping)."""
        return self.holds is not None and self.holds.pending

    # ------------------------------------------------------------------ 4. end
    def finished(self, req_id: str) -> bool:
        """The request ended: True when its blocks must stay allocated until the worker side
        reports its stores done (it is in the next step's ``delayed_frees``)."""
        if tracing():
            trace("finished", req=req_id)
        state = self._reqs.pop(RequestId(req_id), None)
        if state is None:
            return False
        self._lookup.release(state)
        if state.has_stores and self.holds is None:
            self._delayed.append(RequestId(req_id))
            return True
        return False  # (with holds, the blocks that stores still read stay pinned)

    def shutdown(self) -> None:
        if self._planner is not None:
            self._planner.close()
        if self.holds is not None:
            self.holds.close()
        self._leader.close()
        if self._early is not None:
            self._early.close()
