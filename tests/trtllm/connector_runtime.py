"""TensorRT-LLM's ``KvCacheConnectorManager``, replayed for an in-process tensor-parallel group.

In TensorRT-LLM every rank is a process with its own manager; the scheduler role exists on rank 0
only, and ``_run_on_leader`` broadcasts its answers (``mpi_broadcast``: rank 0 keeps the very
object, the other ranks get a pickled copy). Worker completions are all-gathered and the runtime
acts on an id only once every rank returned it. This module plays all ranks' managers in one
process and keeps that behaviour, including the per-rank bookkeeping of asynchronous requests:

    new (not yet passed to get_finished) -> pending (passed, not returned)
        -> local_finished (returned by this rank) -> done (returned by every rank)

It also builds the ``SchedulerOutput`` the way ``KvCacheConnectorSchedulerOutputManager`` does
and hands ``get_num_new_matched_tokens`` the request as C++ casts it (bound attributes only).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    RequestData,
    SchedulerOutput,
)
from tensorrt_llm.bindings import LlmRequestState
from tensorrt_llm.bindings.internal.batch_manager import LlmRequest as BoundLlmRequest


class ConnectorContractError(RuntimeError):
    """The connector broke a rule TensorRT-LLM enforces (or crashes on)."""


_BOUND_ATTRIBUTES = frozenset(n for n in dir(BoundLlmRequest(0, 1, [0]))
                              if not n.startswith("_") and n != "set_prepopulated_prompt_len")


class BoundRequestView:
    """The request ``get_num_new_matched_tokens`` receives: called from C++, TensorRT-LLM passes
    the bound base ``LlmRequest``, so the executor's Python-side ``py_*`` attributes are absent."""

    __slots__ = ("_request",)

    def __init__(self, request: BoundLlmRequest) -> None:
        object.__setattr__(self, "_request", request)

    def __getattr__(self, name: str):
        if name in _BOUND_ATTRIBUTES:
            return getattr(self._request, name)
        raise AttributeError(f"the bound LlmRequest has no attribute {name!r} (get_num_new_matched_tokens is "
                             "called from C++ with the base class; py_* attributes are not visible there)")

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"get_num_new_matched_tokens must not modify the request ({name!r})")


@dataclass
class _AsyncRequests:
    saving: dict = field(default_factory=dict)
    loading: dict = field(default_factory=dict)

    def take_all_from(self, other: "_AsyncRequests") -> None:
        self.saving.update(other.saving)
        self.loading.update(other.loading)
        other.saving, other.loading = {}, {}

    def extract(self, saving_ids: Iterable[int], loading_ids: Iterable[int], who: str) -> "_AsyncRequests":
        out = _AsyncRequests()
        for ids, src, dst, kind in ((saving_ids, self.saving, out.saving, "saving"),
                                    (loading_ids, self.loading, out.loading, "loading")):
            for rid in ids:
                if rid not in src:
                    raise ConnectorContractError(f"{who} returned request {rid!r} as finished {kind} without it "
                                                 "being passed in (or returned it twice)")
                dst[rid] = src.pop(rid)
        return out

    def __bool__(self) -> bool:
        return bool(self.saving or self.loading)


@dataclass
class _RankState:
    new: _AsyncRequests = field(default_factory=_AsyncRequests)
    pending: _AsyncRequests = field(default_factory=_AsyncRequests)
    local_finished: _AsyncRequests = field(default_factory=_AsyncRequests)


@dataclass
class _Reported:
    num_block_ids: int = 0
    num_tokens: int = 0


class SchedulerOutputBuilder:
    """``KvCacheConnectorSchedulerOutputManager``: deltas of tokens and blocks per request."""

    def __init__(self) -> None:
        self._reported: dict[int, _Reported] = {}
        self._external_loads: dict[int, int] = {}

    def record_external_load(self, request_id: int, num_tokens: int) -> None:
        self._external_loads[request_id] = num_tokens

    def build(self, context_requests: Sequence, generation_requests: Sequence, parked_ids: set,
              block_ids_of: Callable[[int], list[int]]) -> SchedulerOutput:
        out = SchedulerOutput()
        for req in context_requests:
            if req.request_id in parked_ids:
                continue
            is_new = req.request_id not in self._reported
            data = self._data(req, block_ids_of)
            if req.request_id in self._external_loads:
                data.computed_position -= self._external_loads[req.request_id]
            (out.new_requests if is_new else out.cached_requests).append(data)
        for req in generation_requests:
            out.cached_requests.append(self._data(req, block_ids_of))
        self._external_loads = {}
        return out

    def _data(self, req, block_ids_of) -> RequestData:
        rep = self._reported.setdefault(req.request_id, _Reported())
        tokens, block_ids = req.get_tokens(0), block_ids_of(req.request_id)
        new_blocks, new_tokens = block_ids[rep.num_block_ids:], tokens[rep.num_tokens:]
        rep.num_block_ids, rep.num_tokens = len(block_ids), len(tokens)
        if req.state in (LlmRequestState.CONTEXT_INIT, LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS):
            computed, scheduled = req.context_current_position, min(req.context_remaining_length,
                                                                    req.context_chunk_size)
        else:
            computed, scheduled = len(tokens) - 1, 1
        return RequestData(req.request_id, new_tokens, new_blocks, computed, scheduled)


class ConnectorRuntime:
    """All ranks' ``KvCacheConnectorManager`` for one scheduler (rank 0) and one worker per rank."""

    def __init__(self, scheduler: KvCacheConnectorScheduler, workers: Sequence[KvCacheConnectorWorker]) -> None:
        self.scheduler, self.workers = scheduler, list(workers)
        self._ranks = [_RankState() for _ in self.workers]
        self._finished_async_loading: set[int] = set()
        self._builder = SchedulerOutputBuilder()
        self._scheduler_output: SchedulerOutput | None = None

    # --- scheduler side (rank 0, broadcast) ---
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        if request.is_generation_only_request:
            raise RuntimeError("Connector API is not supported for generation-only requests!")
        answer = self.scheduler.get_num_new_matched_tokens(BoundRequestView(request), num_computed_tokens)
        num_tokens, load_async = _checked_match(answer)
        if num_tokens == 0 and load_async:
            raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
        if load_async:
            for rank in self._ranks:
                rank.new.loading[request.request_id] = request
        self._builder.record_external_load(request.request_id, num_tokens)
        return num_tokens

    def update_state_after_alloc(self, request, block_ids: list[int]) -> None:
        self.scheduler.update_state_after_alloc(request, list(block_ids))  # rank 0 only, nothing broadcast

    def should_add_sequence(self, request) -> bool:
        return request.request_id not in self._finished_async_loading

    def build_scheduler_output(self, context_requests, generation_requests, block_ids_of) -> None:
        parked = set(self._ranks[0].new.loading)
        self._scheduler_output = self._builder.build(context_requests, generation_requests, parked, block_ids_of)

    def handle_metadata(self) -> None:
        if self._scheduler_output is None:
            return
        metadata = self.scheduler.build_connector_meta(self._scheduler_output)
        self._scheduler_output = None
        for rank, worker in enumerate(self.workers):
            worker.bind_connector_meta(metadata if rank == 0 else pickle.loads(pickle.dumps(metadata)))

    def take_scheduled_requests_pending_load(self, context_requests: list) -> list:
        """Drop the requests parked for an asynchronous load from the batch (and park them)."""
        allowed = []
        for req in context_requests:
            if req.request_id in self._ranks[0].new.loading:
                req.state = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
            else:
                allowed.append(req)
        return allowed

    def request_finished(self, request, cache_block_ids: list[int]) -> bool:
        self._finished_async_loading.discard(request.request_id)
        saving = bool(self.scheduler.request_finished(request, list(cache_block_ids)))  # truthiness, as TRT-LLM
        if saving:
            for rank in self._ranks:
                rank.new.saving[request.request_id] = request
            request.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
        return saving

    # --- worker side (every rank, all-gathered) ---
    def get_finished(self) -> tuple[list, list]:
        """Poll every worker; returns (requests saved on every rank, requests loaded on every rank)."""
        local = []
        for r, (rank, worker) in enumerate(zip(self._ranks, self.workers)):
            started, finished_gen = sorted(rank.new.loading), sorted(rank.new.saving)
            rank.pending.take_all_from(rank.new)
            answer = worker.get_finished(finished_gen, started)
            if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
                raise ConnectorContractError(f"get_finished on rank {r} returned {answer!r}, not two id lists")
            rank.local_finished.take_all_from(rank.pending.extract(answer[0], answer[1], f"worker rank {r}"))
            local.append((set(rank.local_finished.saving), set(rank.local_finished.loading)))
        saved = set.intersection(*(s for s, _ in local))
        loaded = set.intersection(*(l for _, l in local))
        done = [rank.local_finished.extract(saved, loaded, "runtime") for rank in self._ranks][0]
        for rid, req in done.loading.items():
            req.state = LlmRequestState.CONTEXT_INIT
            self._finished_async_loading.add(rid)
        return list(done.saving.values()), list(done.loading.values())

    def is_loading(self, request_id: int) -> bool:
        """The request answered asynchronous and not every rank has reported it loaded."""
        rank = self._ranks[0]
        return any(request_id in part.loading for part in (rank.new, rank.pending, rank.local_finished))

    def has_pending_transfers(self) -> bool:
        return any(rank.new or rank.pending or rank.local_finished for rank in self._ranks)


def _checked_match(answer) -> tuple[int, bool]:
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
        raise ConnectorContractError(f"get_num_new_matched_tokens returned {answer!r}, not (int, bool)")
    num_tokens, load_async = answer
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ConnectorContractError(f"get_num_new_matched_tokens returned {num_tokens!r} tokens")
    return num_tokens, bool(load_async)
