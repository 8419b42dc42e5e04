"""A replay of TensorRT-LLM's PyTorch executor loop, call for call, for KV cache connectors.

One iteration (``PyExecutor._executor_loop``; ``TRTLLM_API.md`` has the citations):

1. schedule (``GUARANTEED_NO_EVICT``, batch size, token budget; :mod:`.batch_scheduler`);
2. ``prepare_resources``: for each new context request, ``add_sequence`` (device prefix match),
   ``get_num_new_matched_tokens(request, device_matched)`` (rank 0, broadcast), the prefill
   position moved past both, ``update_state_after_alloc(request, block_ids)`` (rank 0); for each
   generation request ``add_token``; then the ``SchedulerOutput`` is built;
3. ``build_connector_meta`` (rank 0) and ``bind_connector_meta`` on every worker;
4. parked requests (asynchronous load) leave the batch; ``start_load_kv`` on every worker;
5. the forward pass: per layer ``wait_for_layer_load`` / layer / ``save_kv_layer``, then
   ``wait_for_save`` (:mod:`.forward_pass`, which also checks every held byte);
6. sample; advance prefill chunks; append tokens (one iteration later with the overlap scheduler);
7. for finished requests ``request_finished(request, block_ids)``; True keeps the blocks;
   the response is sent; the others' blocks are freed (full blocks stored for device reuse);
8. ``get_finished`` on every worker (every iteration, even with nothing scheduled): blocks of
   requests saved on every rank are freed, requests loaded on every rank become schedulable.

A connector hook raising inside the forward pass fails every active request, as TensorRT-LLM's
``_handle_errors`` does (optionally resubmitted, as a client would); any other connector
exception ends the run, as it ends TensorRT-LLM's executor loop.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import xxhash

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm.bindings import LlmRequestState

from .batch_scheduler import BatchScheduler, ScheduledBatch
from .block_pool import DeviceBlockPool, chain_block_keys
from .connector_runtime import ConnectorRuntime
from .driver_setup import ConnectorFactories, DriverConfig, construct_connectors
from .forward_pass import ConnectorHookError, ForwardPass, PassItem
from .kv_model import KvModel
from .paged_kv import PagedKvCache
from .report import DriverReport, DriverStats, RequestResult
from .workload import RequestSpec, Workload


__all__ = ["ConnectorFactories", "Driver", "DriverConfig", "DriverStallError"]


class DriverStallError(RuntimeError):
    """Nothing progressed for ``stall_timeout_s`` (e.g. a transfer the connector never finishes)."""


@dataclass(eq=False)
class _Record:
    """The driver's side of one request attempt. ``tokens`` are the device's view (in overlap mode
    they run one token ahead of ``request.get_tokens(0)``)."""

    spec: RequestSpec
    request: LlmRequest
    result: RequestResult
    root: int
    tokens: list[int]
    seeds: list[int] = field(default_factory=list)
    has_sequence: bool = False
    onboarded_until: int = 0
    kv_valid: int = 0  # positions whose KV a successful pass (or the device cache) completed


class Driver:
    """Drives a connector (or none) through TensorRT-LLM's executor loop; see the module doc.

    Owns the KV pools (one per rank), the block pool, the connector roles and their runtime.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, config: DriverConfig = DriverConfig(), connectors: Optional[ConnectorFactories] = None):
        self.config = config
        g = config.geometry
        self.model = KvModel(g, config.vocab_size, config.tenant_sensitive_kv)
        self.pool = DeviceBlockPool(config.num_blocks, g.tokens_per_block, config.enable_block_reuse)
        self.caches = [PagedKvCache(g, config.num_blocks, r, config.device) for r in range(g.tp_size)]
        device = torch.device(config.device)
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.llm_args = config.llm_args(connectors.config if connectors else None)
        self.runtime: Optional[ConnectorRuntime] = None
        self._closed = False
        try:
            callbacks = self._init_connector(connectors) if connectors is not None else []
        except BaseException:
            self.close()
            raise
        self.forward = ForwardPass(self.model, self.caches, self.runtime.workers if self.runtime else None,
                                   self.stream, config.verify, callbacks)
        self.scheduler = BatchScheduler(g.tokens_per_block, config.max_batch_size, config.max_num_tokens,
                                        config.enable_chunked_prefill, lambda: self.pool.num_free_blocks,
                                        self._blocks_held)
        self.stats = DriverStats()
        self._report = DriverReport(stats=self.stats)
        self._next_request_id = config.max_batch_size  # TensorRT-LLM reserves the first ids for dummies
        self._arrivals: deque[tuple[RequestSpec, int]] = deque()
        self._active: list[_Record] = []
        self._records: dict[int, _Record] = {}
        self._holding: dict[int, _Record] = {}  # finished, blocks kept for a connector save
        self._unsampled: list[tuple[_Record, int]] = []  # overlap: sampled, not yet given to the request
        self._workload: Optional[Workload] = None

    def _init_connector(self, connectors: ConnectorFactories) -> list:
        """``py_executor_creator`` + ``_maybe_init_kv_connector_manager``: construct, register the
        pools, wait for initialization; returns the end-of-forward callables."""
        self.runtime = ConnectorRuntime(*construct_connectors(connectors, self.llm_args, self.config.geometry.tp_size))
        # NOTE: every rank is a process of its own in TensorRT-LLM, so the ranks register their
        # pools concurrently; a worker that waits for its node's pools (planned once every
        # rank's layout is known) would otherwise wait for the next rank forever.
        with ThreadPoolExecutor(max_workers=len(self.caches)) as pool:
            list(pool.map(lambda wc: wc[0].register_kv_caches(wc[1].tensor), zip(self.runtime.workers, self.caches)))
        self.runtime.scheduler.wait_for_initialization()
        return [cb for w in self.runtime.workers if (cb := w.register_forward_pass_callable()) is not None]

    # --- public ---
    def run(self, workload: Workload) -> DriverReport:
        """Run ``workload`` to completion (every request answered, every transfer finished)."""
        self._workload = workload
        self._arrivals.extend((spec, 0) for spec in workload.start())
        last_progress = time.monotonic()
        while self._busy():
            if self._step():
                last_progress = time.monotonic()
            else:
                time.sleep(self.config.idle_sleep_s)
            if time.monotonic() - last_progress > self.config.stall_timeout_s:
                raise DriverStallError(self._describe())
        self.stats.device_reused_blocks = self.pool.stats.reused_blocks
        self.stats.device_evicted_blocks = self.pool.stats.evicted_blocks
        return self._report

    def close(self) -> None:
        """Let the connector roles shut down (if they can), then free the pools. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.runtime is not None:
                # NOTE: workers first: their stores in flight finish while the scheduler's leader
                # session, which planned them, is still open.
                for role in [*self.runtime.workers, self.runtime.scheduler]:
                    shutdown = getattr(role, "shutdown", None)
                    if callable(shutdown):
                        shutdown()
        finally:
            for cache in self.caches:
                cache.close()

    def __enter__(self) -> "Driver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- one executor iteration ---
    def _step(self) -> bool:
        self.stats.iterations += 1
        self._admit_arrivals()
        batch = self.scheduler.schedule([rec.request for rec in self._active])
        produced: list[tuple[_Record, int]] = []
        if batch.batch_size:
            self._prepare_resources(batch)
            if self.runtime is not None:
                self.runtime.handle_metadata()
                batch.context_requests = self.runtime.take_scheduled_requests_pending_load(batch.context_requests)
                for worker in self.runtime.workers:
                    worker.start_load_kv(self.stream)
            if batch.batch_size:
                try:
                    self._forward(batch)
                    produced = self._sample(batch)
                except ConnectorHookError as exc:
                    self._fail_active(str(exc))
        if self.config.overlap_scheduler:
            produced, self._unsampled = self._unsampled, produced
        finished = self._apply_tokens(produced)
        self._finish(finished)
        moved = self._poll_connector()
        return bool(batch.batch_size or finished or moved)

    def _prepare_resources(self, batch: ScheduledBatch) -> None:
        for req in batch.context_requests:
            rec = self._records[req.request_id]
            if not rec.has_sequence and (self.runtime is None or self.runtime.should_add_sequence(req)):
                self._add_sequence(rec)
        for req in batch.generation_requests:
            rec = self._records[req.request_id]
            self._poison(self.pool.add_token(req.request_id, len(rec.tokens)))
        if self.runtime is not None:
            self.runtime.build_scheduler_output(batch.context_requests, batch.generation_requests,
                                                self.pool.get_cache_indices)

    def _add_sequence(self, rec: _Record) -> None:
        req, b = rec.request, self.config.geometry.tokens_per_block
        keys = chain_block_keys(rec.tokens, b, (req.prompt_len - 1) // b, req.cache_salt_id, req.lora_task_id)
        alloc = self.pool.add_sequence(req.request_id, keys, -(-req.prompt_len // b))
        self._poison(alloc.fresh_block_ids)
        rec.has_sequence = True
        device = alloc.num_matched_blocks * b
        # NOTE: with block reuse off TensorRT-LLM's addSequence never asks the connector (it logs
        # that the connector is ignored); update_state_after_alloc and the metadata still happen.
        asks = self.runtime is not None and self.config.enable_block_reuse
        matched = self.runtime.get_num_new_matched_tokens(req, device) if asks else 0
        req.set_prepopulated_prompt_len(device + matched, b)  # raises unless a prompt token is left
        rec.result.device_matched_tokens, rec.result.connector_matched_tokens = device, matched
        rec.result.load_async = bool(self.runtime and self.runtime.is_loading(req.request_id))
        rec.onboarded_until = device + matched
        rec.kv_valid = device
        self.stats.connector_matched_tokens += matched
        if self.runtime is not None:
            self.runtime.update_state_after_alloc(req, self.pool.get_cache_indices(req.request_id))

    def _forward(self, batch: ScheduledBatch) -> None:
        work, first_reads = [], []
        for req in batch.context_requests:
            rec = self._records[req.request_id]
            start = req.context_current_position
            work.append((rec, self._item(rec, start, start + req.context_chunk_size)))
            if start == rec.onboarded_until and rec.onboarded_until > rec.result.device_matched_tokens:
                first_reads.append(rec)
        for req in batch.generation_requests:
            rec = self._records[req.request_id]
            work.append((rec, self._item(rec, len(rec.tokens) - 1, len(rec.tokens))))
        before = self.forward.verified_positions
        self.forward.run([item for _, item in work])
        b = self.config.geometry.tokens_per_block
        for rec, item in work:
            rec.kv_valid = item.stop
        for req in batch.context_requests:  # update_resources: store_context_blocks
            rec = self._records[req.request_id]
            full = min(req.prompt_len, rec.kv_valid) // b
            self.pool.store(req.request_id, chain_block_keys(rec.tokens, b, full, req.cache_salt_id, req.lora_task_id))
        self.stats.forward_passes += 1
        self.stats.verified_positions += self.forward.verified_positions - before
        if self.config.verify:
            self.stats.onboarded_blocks += sum(-(-r.onboarded_until // b) - r.result.device_matched_tokens // b
                                               for r in first_reads)

    def _item(self, rec: _Record, start: int, stop: int) -> PassItem:
        seeds = np.asarray(rec.seeds[:stop], dtype=np.uint64)
        return PassItem(rec.spec.name, self.pool.get_cache_indices(rec.request.request_id), seeds, start, stop,
                        rec.result.device_matched_tokens, rec.onboarded_until)

    def _sample(self, batch: ScheduledBatch) -> list[tuple[_Record, int]]:
        """Advance prefill chunks; sample a token for every request that completed a position."""
        records = []
        for req in batch.context_requests:
            req.move_to_next_context_chunk()
            if req.context_remaining_length == 0:
                records.append(self._records[req.request_id])
        records += [self._records[req.request_id] for req in batch.generation_requests]
        produced = []
        for rec in records:
            n = len(rec.tokens)
            token = self.forward.sample(self._item(rec, n, n))
            rec.tokens.append(token)
            self.model.extend_seeds(rec.seeds, rec.root, rec.tokens)
            produced.append((rec, token))
            done = len(rec.tokens) - rec.request.prompt_len >= rec.spec.max_new_tokens
            overlap_done = done and self.config.overlap_scheduler
            rec.request.state = (LlmRequestState.GENERATION_TO_COMPLETE if overlap_done
                                 else LlmRequestState.GENERATION_IN_PROGRESS)
        return produced

    def _apply_tokens(self, produced: list[tuple[_Record, int]]) -> list[_Record]:
        """The sampler's ``update_requests``: the request gets its token; returns the finished."""
        finished = []
        for rec, token in produced:
            if rec.result.error is not None:
                continue
            rec.request.add_new_token(token, 0)
            rec.result.output_tokens.append(token)
            if len(rec.result.output_tokens) >= rec.spec.max_new_tokens:
                rec.request.state = LlmRequestState.GENERATION_COMPLETE
                finished.append(rec)
        return finished

    def _finish(self, finished: list[_Record]) -> None:
        """``_send_kv_async`` (``request_finished``), then ``_handle_responses``."""
        held = set()
        for rec in finished:
            rid = rec.request.request_id
            if self.runtime is not None and self.runtime.request_finished(rec.request, self.pool.get_cache_indices(rid)):
                self.stats.delayed_frees += 1
                held.add(rid)
                if self.config.honour_delayed_free:
                    self._holding[rid] = rec
        for rec in finished:
            self._active.remove(rec)
            rid = rec.request.request_id
            if rid not in held:
                self._release(rec)
            elif not self.config.honour_delayed_free:
                self._release(rec, reused_at_once=True)
            self._report.results[rec.spec.name] = rec.result
            self._arrivals.extend((spec, 0) for spec in self._workload.on_finished(rec.spec, rec.result.output_tokens))

    def _poll_connector(self) -> bool:
        if self.runtime is None:
            return False
        saved, loaded = self.runtime.get_finished()
        for req in saved:
            rec = self._holding.pop(req.request_id, None)
            if rec is not None:
                self._release(rec)
        for req in loaded:
            self.stats.async_loads += 1
            rec = self._records[req.request_id]
            if rec.result.error is not None:  # failed while its load was in flight
                self._release(rec)
        return bool(saved or loaded)

    # --- failures ---
    def _fail_active(self, message: str) -> None:
        """TensorRT-LLM's ``_handle_errors``: every active request fails and is terminated (no
        ``request_finished``); a request whose asynchronous load is in flight keeps its blocks
        until the load is reported."""
        for rec in list(self._active):
            self._active.remove(rec)
            rec.request.state = LlmRequestState.GENERATION_COMPLETE
            rec.result.error = message
            self.stats.failed_attempts += 1
            self._report.failed_attempts.append(rec.result)
            self.scheduler.forget(rec.request.request_id)
            if rec.has_sequence and not (self.runtime and self.runtime.is_loading(rec.request.request_id)):
                self._release(rec)
            if rec.result.attempt < self.config.max_retries:
                self._arrivals.append((rec.spec, rec.result.attempt + 1))
            else:
                self._report.results[rec.spec.name] = rec.result
        self._unsampled = []

    # --- helpers ---
    def _admit_arrivals(self) -> None:
        while self._arrivals:
            spec, attempt = self._arrivals.popleft()
            salt_id = xxhash.xxh64_intdigest(spec.salt.encode()) if spec.salt is not None else None
            rid = self._next_request_id
            self._next_request_id += 1
            req = LlmRequest(rid, spec.max_new_tokens, list(spec.tokens), lora_task_id=spec.lora_task_id,
                             cache_salt_id=salt_id)
            if self.scheduler.lifetime_blocks(req) > self.pool.num_blocks:
                raise ValueError(f"request {spec.name} needs more blocks than the pool has")
            rec = _Record(spec, req, RequestResult(spec.name, rid, attempt, req.prompt_len),
                          self.model.root_seed(salt_id, spec.lora_task_id), list(spec.tokens))
            self.model.extend_seeds(rec.seeds, rec.root, rec.tokens)
            self._records[rid] = rec
            self._active.append(rec)

    def _release(self, rec: _Record, reused_at_once: bool = False) -> None:
        """``free_resources``: store the full blocks whose KV is complete, free the sequence.

        NOTE: complete means within the first ``len(tokens) - 1`` tokens (the last sampled token
        has no KV yet) *and* written by a pass that succeeded, so a failed pass never plants
        unwritten blocks in the device cache. ``reused_at_once`` (the negative control of the
        delayed free) stores nothing and poisons every freed block, as if another request took
        them immediately.
        """
        req, b = rec.request, self.config.geometry.tokens_per_block
        tokens = req.get_tokens(0)
        full = 0 if reused_at_once else min(len(tokens) - 1, rec.kv_valid) // b
        keys = chain_block_keys(tokens, b, full, req.cache_salt_id, req.lora_task_id)
        self._poison(self.pool.release(req.request_id, keys, drop_cached=reused_at_once))
        self.scheduler.forget(req.request_id)

    def _poison(self, block_ids) -> None:
        for cache in self.caches:
            cache.poison(block_ids)

    def _blocks_held(self, request_id: int) -> int:
        return len(self.pool.get_cache_indices(request_id)) if self.pool.has_sequence(request_id) else 0

    def _busy(self) -> bool:
        return bool(self._arrivals or self._active or self._holding or self._unsampled
                    or (self.runtime is not None and self.runtime.has_pending_transfers()))

    def _describe(self) -> str:
        states = {rec.spec.name: rec.request.state.name for rec in self._active}
        return (f"no progress for {self.config.stall_timeout_s}s: active {states}, holding for a save "
                f"{sorted(self._holding)}, connector transfers pending "
                f"{bool(self.runtime and self.runtime.has_pending_transfers())}")
