"""Test doubles of a TensorRT-LLM KV cache connector that stores nothing.

``RecomputeOnlyConnectorScheduler`` / ``RecomputeOnlyConnectorWorker`` match nothing, save
nothing and answer every call the way a connector may; they record every call in an optional
:class:`CallLog` and assert what a worker may rely on (metadata bound before ``start_load_kv``,
layers in order, no asynchronous ids for a connector that never answers asynchronously), so a
test can check the driver's call order. With them everything is recomputed.
``RaisingConnectorWorker`` raises from one hook of one pass (a lost kvbm worker, say).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    SchedulerOutput,
)
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs


@dataclass
class CallLog:
    """Every connector call, in order: ``(role, rank, method, detail)``."""

    entries: list[tuple[str, int, str, object]] = field(default_factory=list)

    def add(self, role: str, rank: int, method: str, detail: object = None) -> None:
        self.entries.append((role, rank, method, detail))

    def methods(self, role: Optional[str] = None, rank: Optional[int] = None) -> list[str]:
        return [m for ro, ra, m, _ in self.entries if (role is None or ro == role) and (rank is None or ra == rank)]


@dataclass(frozen=True)
class RecomputeOnlyMetadata:
    new_request_ids: tuple[int, ...]
    cached_request_ids: tuple[int, ...]


class RecomputeOnlyConnectorScheduler(KvCacheConnectorScheduler):
    """TEST DOUBLE (scheduler role): never matches, never saves."""

    def __init__(self, llm_args: TorchLlmArgs, call_log: Optional[CallLog] = None):
        super().__init__(llm_args)
        self.log = call_log or CallLog()

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        self.log.add("scheduler", 0, "get_num_new_matched_tokens", (request.request_id, num_computed_tokens))
        return 0, False

    def update_state_after_alloc(self, request, block_ids: list[int]) -> None:
        self.log.add("scheduler", 0, "update_state_after_alloc", (request.request_id, tuple(block_ids)))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RecomputeOnlyMetadata:
        meta = RecomputeOnlyMetadata(tuple(r.request_id for r in scheduler_output.new_requests),
                                     tuple(r.request_id for r in scheduler_output.cached_requests))
        self.log.add("scheduler", 0, "build_connector_meta", scheduler_output)
        return meta

    def request_finished(self, request, cache_block_ids: list[int]) -> bool:
        self.log.add("scheduler", 0, "request_finished", (request.request_id, tuple(cache_block_ids)))
        return False


class RecomputeOnlyConnectorWorker(KvCacheConnectorWorker):
    """TEST DOUBLE (worker role): moves no bytes; checks the call order it is given."""

    def __init__(self, llm_args: TorchLlmArgs, call_log: Optional[CallLog] = None):
        super().__init__(llm_args)
        self.rank = llm_args.parallel_config.to_mapping().rank
        self.log = call_log or CallLog()
        self.kv_cache_tensor = None
        self._next_layer = 0

    def register_kv_caches(self, kv_cache_tensor) -> None:
        assert self.kv_cache_tensor is None, "register_kv_caches is called once"
        self.kv_cache_tensor = kv_cache_tensor
        self.log.add("worker", self.rank, "register_kv_caches", tuple(kv_cache_tensor.shape))

    def bind_connector_meta(self, metadata: object) -> None:
        super().bind_connector_meta(metadata)
        self.log.add("worker", self.rank, "bind_connector_meta", metadata)

    def start_load_kv(self, stream) -> None:
        assert isinstance(self.get_connector_meta(), RecomputeOnlyMetadata), "metadata is bound first"
        self._next_layer = 0
        self.log.add("worker", self.rank, "start_load_kv")

    def wait_for_layer_load(self, layer_idx: int, stream) -> None:
        assert layer_idx == self._next_layer, f"layer {layer_idx} loaded out of order"
        self.log.add("worker", self.rank, "wait_for_layer_load", layer_idx)

    def save_kv_layer(self, layer_idx: int, stream) -> None:
        assert layer_idx == self._next_layer, f"layer {layer_idx} saved out of order"
        self._next_layer += 1
        self.log.add("worker", self.rank, "save_kv_layer", layer_idx)

    def wait_for_save(self, stream) -> None:
        self.log.add("worker", self.rank, "wait_for_save")

    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]):
        assert not finished_gen_req_ids and not started_loading_req_ids, "this connector never goes async"
        self.log.add("worker", self.rank, "get_finished")
        return [], []


class RaisingConnectorWorker(RecomputeOnlyConnectorWorker):
    """TEST DOUBLE: on rank 0, ``method`` raises ``exc`` during the ``on_pass``-th pass (passes are
    counted by ``start_load_kv``); otherwise a recompute-only worker."""

    def __init__(self, llm_args: TorchLlmArgs, call_log: Optional[CallLog] = None, *,
                 method: str = "wait_for_layer_load", on_pass: int = 2, exc: Exception = ConnectionError("lost")):
        super().__init__(llm_args, call_log)
        self.method, self.on_pass, self.exc, self.passes = method, on_pass, exc, 0

    def start_load_kv(self, stream) -> None:
        super().start_load_kv(stream)
        self.passes += 1
        self._maybe_raise("start_load_kv")

    def wait_for_layer_load(self, layer_idx: int, stream) -> None:
        self._maybe_raise("wait_for_layer_load")
        super().wait_for_layer_load(layer_idx, stream)

    def save_kv_layer(self, layer_idx: int, stream) -> None:
        self._maybe_raise("save_kv_layer")
        super().save_kv_layer(layer_idx, stream)

    def wait_for_save(self, stream) -> None:
        self._maybe_raise("wait_for_save")
        super().wait_for_save(stream)

    def _maybe_raise(self, method: str) -> None:
        if self.rank == 0 and method == self.method and self.passes == self.on_pass:
            raise self.exc
