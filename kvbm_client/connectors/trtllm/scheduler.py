"""Scheduler role of the TensorRT-LLM connector: TensorRT-LLM's scheduler hooks over the shared core.

Runs on rank 0 only, on the executor's thread; what it returns is broadcast to every rank
(the metadata pickled). Everything engine-independent (match and pin, early loads, store
batching, delayed frees, the leader link) is :class:`~kvbm_client.connectors.core.SchedulerCore`;
this adapter translates TensorRT-LLM's calls (``tests/trtllm/TRTLLM_API.md`` §3 and §6 cite them):

1. ``get_num_new_matched_tokens(request, num_computed_tokens)``: once per request, after the
   device (G1) prefix match of ``num_computed_tokens`` (whole blocks). kvbm answers the full
   blocks after it, within the first ``prompt_len - 1`` tokens, so
   ``num_computed_tokens + n < prompt_len``; never ``(0, True)``; a device match that ends
   inside a block (partial reuse on) gets no hit, so kvbm never writes a shared device block.
2. ``update_state_after_alloc(request, block_ids)``: every block of the request, in token
   order; the hit is planned into the blocks after the device match (and started early).
3. ``build_connector_meta(scheduler_output)``: tokens and blocks grow from the ``RequestData``
   deltas; the KV complete after the pass is ``computed_position (+ the connector's tokens,
   for a request new in the iteration of its lookup) + num_scheduled_tokens``; the core's
   :class:`~kvbm_client.connectors.core.StepPlan` is the metadata (picklable; a new object
   every step, never touched after it is returned).
4. ``request_finished(request, cache_block_ids)``: True keeps the blocks until every rank's
   worker role reports the request's stores done (``get_finished``), and a request cancelled
   while parked for its asynchronous load until the load settled.

Requests that TensorRT-LLM terminates without ``request_finished`` (``_handle_errors`` fails
every active request) are found by their finished state and dropped like preempted ones: the
step's plan then fences (see :meth:`KvbmConnectorScheduler._orphans`).

No hook raises (an exception outside the forward pass ends TensorRT-LLM's executor loop):
failures are logged and answered the safe way (no hit, keep the blocks).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...logs import attach_engine_logging
from ..core.early_loads import EarlyLoads, early_loads_decision
from ..core.leader_link import LeaderLink, LeaderPort
from ..core.request_keys import EngineRequest
from ..core.scheduler import SchedulerCore
from ..core.specs import RequestId, StepPlan
from .compat import KvCacheConnectorScheduler, SchedulerOutput
from .requests import TokenView, request_extras, request_id
from .settings import config_warnings, trtllm_settings

log = logging.getLogger("kvbm.connector")

#: Builds in a row that must see a tracked request finished before it counts as terminated.
ORPHAN_STRIKES = 2


def _extras_of(view: EngineRequest) -> Any:
    assert isinstance(view, TokenView), "the TensorRT-LLM adapter hands the core its own views"
    return view.extras


@dataclass
class _Tracked:
    """The adapter's side of one request, from its lookup to its end."""

    view: TokenView
    #: the executor's ``LlmRequest`` (from ``update_state_after_alloc``), read for its state
    request: Any = None
    #: consecutive builds that found the request finished without ``request_finished``
    strikes: int = 0
    #: parked for an asynchronous load and not scheduled since (the load may still be writing)
    parked: bool = False


class KvbmConnectorScheduler(KvCacheConnectorScheduler):
    """TensorRT-LLM's ``KvCacheConnectorScheduler`` over kvbm (rank 0).

    Args:
        llm_args: TensorRT-LLM's ``TorchLlmArgs`` (the only argument TensorRT-LLM passes).
        leader: the leader link (default: a :class:`LeaderLink`; tests pass a fake).
    """

    def __init__(self, llm_args: Any, leader: LeaderPort | None = None) -> None:
        super().__init__(llm_args)
        attach_engine_logging()
        settings = trtllm_settings(llm_args)
        for warning in config_warnings(llm_args):
            log.warning("kvbm: %s", warning)
        # NOTE: the overlap scheduler runs two iterations at once, and TensorRT-LLM frees a finished
        # request's blocks while the iteration that may still write them runs (no deferred frees):
        # only the worker role orders a load after it (its start_load_kv)
        early_ok, why = early_loads_decision(settings.core.early_loads, bool(settings.worker_ids),
                                             settings.overlapping_steps, defers_block_frees=False)
        log.info("kvbm: early loads %s (%s)", "on" if early_ok else "off", why)
        early = EarlyLoads(settings.core, settings.worker_ids) if early_ok else None
        self.block_size = settings.block_size
        self.core = SchedulerCore(settings.block_size, settings.core,
                                  leader or LeaderLink(settings.core, "trtllm-scheduler"), _extras_of, early,
                                  overlapping_steps=settings.overlapping_steps)
        self._tracked: dict[RequestId, _Tracked] = {}
        #: connector tokens of lookups since the last build (TensorRT-LLM subtracts exactly
        #: these from a new request's ``computed_position`` in the next build)
        self._external: dict[RequestId, int] = {}

    @property
    def num_tracked(self) -> int:
        """Requests between their lookup and their end (for tests and leak checks)."""
        return len(self._tracked)

    # ------------------------------------------------------------------ 1. lookup
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        try:
            return self._lookup(request, num_computed_tokens)
        except Exception:  # noqa: BLE001 - a raise here ends TensorRT-LLM's executor loop
            log.exception("kvbm: lookup of request %s failed; no hit", getattr(request, "request_id", "?"))
            return 0, False

    def _lookup(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request_id(request)
        prompt = list(request.get_tokens(0))[:request.prompt_len]
        tracked = self._tracked[rid] = _Tracked(TokenView(rid, prompt, request_extras(request)))
        if num_computed_tokens % self.block_size:
            return 0, False  # the device match ends inside a (shared) block: nothing to load after it
        num_tokens, asynchronous = self.core.lookup(tracked.view, num_computed_tokens)
        if num_tokens <= 0:
            return 0, False
        self._external[rid] = num_tokens
        tracked.parked = asynchronous
        return num_tokens, asynchronous

    # ------------------------------------------------------------------ 2. allocation
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        try:
            rid = request_id(request)
            tracked = self._tracked.get(rid)
            if tracked is None:
                return  # never looked up (block reuse off, dummy request): kvbm leaves it alone
            tracked.request = request
            self.core.assign_blocks(rid, block_ids, replace=True)
            if self.core.pending_load(rid):
                self.core.allocated(rid, list(block_ids), self._external.get(rid, 0))
        except Exception:  # noqa: BLE001
            log.exception("kvbm: update_state_after_alloc of request %s failed", getattr(request, "request_id", "?"))

    # ------------------------------------------------------------------ 3. step
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        try:
            return self._build(scheduler_output)
        except Exception:  # noqa: BLE001
            log.exception("kvbm: build_connector_meta failed; this step loads and stores nothing")
            self._external.clear()
            return StepPlan()

    def _build(self, so: SchedulerOutput) -> StepPlan:
        computed: dict[str, int] = {}
        for is_new, batch in ((True, so.new_requests), (False, so.cached_requests)):
            for data in batch:
                rid = RequestId(str(data.request_id))
                tracked = self._tracked.get(rid)
                if tracked is None:
                    continue
                if is_new:  # all its tokens and blocks; kvbm's tokens are not in computed_position
                    tracked.view.catch_up(data.new_tokens)
                    tracked.parked = False
                else:
                    tracked.view.extend(data.new_tokens)
                self.core.assign_blocks(rid, data.new_block_ids, replace=is_new)
                external = self._external.get(rid, 0) if is_new else 0
                computed[rid] = data.computed_position + external + data.num_scheduled_tokens
        self._external.clear()
        orphans = self._orphans(set(computed))
        plan = self.core.step(computed, preempted=orphans)
        for rid in orphans:
            log.info("kvbm: request %s ended without request_finished; dropped", rid)
            self.core.finished(rid)
            del self._tracked[rid]
        return plan

    def _orphans(self, scheduled: set[str]) -> list[RequestId]:
        """Requests TensorRT-LLM terminated without ``request_finished`` (``_handle_errors``).

        NOTE: a request that finished normally gets ``request_finished`` in the iteration it
        completes (one later with the overlap scheduler), before the next build; one still
        tracked and finished at :data:`ORPHAN_STRIKES` builds in a row was freed otherwise.
        Its blocks are free again, so the plan must fence like a preemption's.
        """
        out = []
        for rid, tracked in self._tracked.items():
            done = (rid not in scheduled and tracked.request is not None
                    and bool(getattr(tracked.request, "is_finished", False)))
            tracked.strikes = tracked.strikes + 1 if done else 0
            if tracked.strikes >= ORPHAN_STRIKES:
                out.append(rid)
        return out

    # ------------------------------------------------------------------ 4. end
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """True (keep the blocks) when stores may read them, or when the request ends while
        parked for its asynchronous load (cancelled), which may still write into them."""
        rid = request_id(request)
        tracked = self._tracked.pop(rid, None)
        self._external.pop(rid, None)
        try:
            return self.core.finished(rid) or (tracked is not None and tracked.parked)
        except Exception:  # noqa: BLE001 - keeping the blocks is always safe: the workers report them
            log.exception("kvbm: request_finished of %s failed; its blocks are kept until the workers report", rid)
            return True

    def shutdown(self) -> None:
        """Close the leader session and the early-load channels (the driver and tests call it)."""
        self.core.shutdown()
