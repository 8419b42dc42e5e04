"""The lookup a request pays before its first step: how many of its tokens kvbm loads.

:class:`HitLookup` answers the engine's "how many tokens can you load after my own ``n``"
(vLLM ``get_num_new_matched_tokens``) for one tracked request (:class:`.request_keys.RequestState`),
on the engine's scheduler thread:

* the first time, one ``PrepareLoad`` that matches, counts the hit and pins the stored prefix
  after the engine's own (local) prefix; the answer is ``(tokens to load, asynchronous)``;
* when the leader's presence filter rules out the first block asked for, it is a miss without a
  round trip (the leader is told with the next call, for its hit rates);
* asked again while the request waits, it answers the same without a round trip as long as the
  engine's own prefix is the same length and the plan is not past its deadline; else it releases
  the plan and plans again (the engine counts the loaded tokens after the local prefix of the call
  it acted on: a plan for another start would land in blocks the engine does not count as loaded).

Invariants: a request holds at most one pinned plan (``state.load``), released here
(:meth:`HitLookup.release`) unless the scheduler core planned it into blocks (``load_sent``); at
least ``settings.min_computed_tokens`` of the prompt are left for the engine to compute (it needs
the last token's logits, and a CUDA graph's uniform decode batch must not load, see
:func:`kvbm_client.connectors.vllm.compat.layerwise_graph_fit`).
"""
from __future__ import annotations

import logging
import time

from ...leader_session import StageAsk
from .leader_link import LeaderPort
from .prefill import PrefillMeter
from .request_keys import EngineRequest, KeyHasher, RequestState
from .settings import ConnectorSettings
from .tracing import trace, tracing

log = logging.getLogger("kvbm.connector")


class HitLookup:
    """Plans (and releases) a request's load from the node's cache; owns no state of its own:
    the plan lives in the request's state, which the scheduler core owns."""

    def __init__(self, block_size: int, settings: ConnectorSettings, leader: LeaderPort, hasher: KeyHasher,
                 prefill: PrefillMeter) -> None:
        self.block_size = block_size
        self.settings = settings
        self._leader = leader
        self._hasher = hasher
        self._prefill = prefill

    def ask(self, state: RequestState, num_computed_tokens: int, stage: StageAsk | None = None) -> tuple[int, bool]:
        """Tokens kvbm loads after the engine's ``num_computed_tokens`` local ones, and
        whether the load is asynchronous (the request then waits for it). ``stage``: a new
        plan is staged on those workers (the leader sends it before it answers)."""
        request: EngineRequest = state.request
        asynchronous = not self.settings.sync_loads
        first = num_computed_tokens // self.block_size
        if state.load is not None and not state.load_sent:
            if self._still_valid(state, first):
                return state.load.num_blocks * self.block_size, asynchronous  # asked again: same answer
            self.release(state)  # the engine's own prefix changed meanwhile, or the plan expired
        num_tokens = len(request.all_token_ids)
        if state.miss_at == (num_computed_tokens, num_tokens):
            return 0, False  # asked again while the request waits for space: same miss
        # NOTE: at least the last prompt token is computed by the engine: it needs its logits
        # (and vLLM's CPU kernels crash, SIGILL, on a prompt that arrives whole); see min_computed_tokens.
        last = (num_tokens - self.settings.min_computed_tokens) // self.block_size
        if first >= last or state.load_sent:
            return 0, False
        t0 = time.perf_counter()
        probe = self._hasher.probe(state, first)
        if probe is not None and not self._leader.may_hold(probe):
            # a prefix match finds nothing: a miss without a round trip, and the request's blocks
            # are hashed when they are stored (off this thread for a big step: see SchedulerCore.step)
            self._leader.unasked(last - first)
            state.miss_at = (num_computed_tokens, num_tokens)
            log.debug("kvbm miss %s: %d blocks after %d local, none stored (presence filter)", request.request_id,
                      last - first, first)
            if tracing():
                trace("prepare_load", req=request.request_id, asked=last - first, planned=0, ms=0.0,
                      hash_ms=round((time.perf_counter() - t0) * 1e3, 3), reused=0, unasked=True)
            return 0, False
        keys = self._hasher.keys(state)
        t1 = time.perf_counter()
        last = min(len(keys), last)
        if first >= last:
            return 0, False
        rate = self._prefill.tokens_per_s if self.settings.cost_aware_loads else 0.0
        handle = self._leader.prepare_load(keys[first:last], count_hit=True, tokens_per_block=self.block_size,
                                           prefill_tokens_per_s=rate, stage=stage)
        if tracing():
            trace("prepare_load", req=request.request_id, asked=last - first,
                  planned=handle.num_blocks if handle is not None else 0,
                  ms=round((time.perf_counter() - t1) * 1e3, 2), hash_ms=round((t1 - t0) * 1e3, 3),
                  reused=state.identity.reused if state.identity is not None else 0)
        if handle is not None and handle.skipped_cost:
            log.debug("kvbm %s: %d matched blocks recomputed, not loaded (faster at %.0f prefill tokens/s)",
                      request.request_id, handle.skipped_cost, rate)
        if handle is None or handle.is_empty:
            if handle is not None:
                state.miss_at = (num_computed_tokens, num_tokens)
            return 0, False
        state.load, state.load_first_block = handle, first
        log.debug("kvbm hit %s: %d blocks after %d local (%s load)", request.request_id, handle.num_blocks, first,
                  self.settings.load_mode.value)
        return handle.num_blocks * self.block_size, asynchronous

    @staticmethod
    def _still_valid(state: RequestState, first: int) -> bool:
        """The held plan may be answered again: it starts where the engine's own prefix ends
        now (a plan for another start would land where the engine does not count it) and its
        deadline has not passed (the worker daemon would refuse it)."""
        assert state.load is not None
        live = state.load.deadline <= 0 or time.monotonic() < state.load.deadline
        return state.load_first_block == first and live

    def release(self, state: RequestState) -> None:
        """Give back the request's pinned plan unless it was planned into the engine's blocks."""
        if state.load is not None and not state.load_sent:
            self._leader.release(state.load)
        state.load = None
