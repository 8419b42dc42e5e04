"""Test doubles of a TensorRT-LLM KV cache connector that offload blocks to process memory.

``StoreConnectorScheduler`` / ``StoreConnectorWorker`` form a small but correct offloading
connector over an :class:`InMemoryBlockStore`: full blocks are saved once their KV is complete
and loaded back into the blocks of later requests with the same prefix (same tokens, salt and
adapter). It proves the driver's onboarding path works (hits pass the byte check) and exercises
both the synchronous and the asynchronous paths of the interface:

* ``load_async``: matches answer ``(n, True)``; the request is parked, the load is carried by the
  metadata built in the same iteration (the parked request is not in its ``SchedulerOutput``, so
  the scheduler takes the block ids from ``update_state_after_alloc``) and reported by
  ``get_finished`` once the id was handed in;
* ``save_async``: nothing is saved during the passes; each pass's metadata carries the blocks a
  request will save, ``request_finished`` answers True, and the worker copies the blocks when
  ``get_finished`` first names the request (which runs every iteration, batch or not) and
  reports them one call later - so a driver that freed the blocks early is caught.

``CorruptingConnectorWorker`` loads every block with one bit flipped: the negative control the
byte check must catch. ``ignore_salt`` makes the scheduler key blocks without the cache salt: the
negative control of tenant isolation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    SchedulerOutput,
)
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

from .block_pool import chain_block_keys
from .driver_setup import ConnectorFactories

Placement = tuple[int, int]  # (block key, device block id)


class InMemoryBlockStore:
    """The doubles' offload tier: block bytes per (key, rank), in this process. A key is present
    once every rank stored its shard."""

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self._data: dict[tuple[int, int], torch.Tensor] = {}
        self.puts = self.gets = 0

    def put(self, key: int, rank: int, data: torch.Tensor) -> None:
        self._data[(key, rank)] = data
        self.puts += 1

    def get(self, key: int, rank: int) -> torch.Tensor:
        self.gets += 1
        return self._data[(key, rank)]

    def contains(self, key: int) -> bool:
        return all((key, rank) in self._data for rank in range(self.world_size))


@dataclass
class StoreMetadata:
    """What the workers do around one pass.

    Attributes:
        loads: Copy store -> device before the pass.
        async_loads: Per parked request, its loads (reported through ``get_finished``).
        saves: Copy device -> store after the pass.
        save_plans: Per request, blocks to save once it finished (``save_async``).
    """

    loads: list[Placement] = field(default_factory=list)
    async_loads: dict[int, list[Placement]] = field(default_factory=dict)
    saves: list[Placement] = field(default_factory=list)
    save_plans: dict[int, list[Placement]] = field(default_factory=dict)


@dataclass
class _Tracked:
    salt: object
    lora: object
    loads: list[tuple[int, int]] = field(default_factory=list)  # (key, block ordinal)
    external: int = 0
    tokens: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    kv_done: int = 0
    planned: int = 0
    has_plan: bool = False


class StoreConnectorScheduler(KvCacheConnectorScheduler):
    """TEST DOUBLE (scheduler role) of an offloading connector; see the module doc."""

    def __init__(self, llm_args: TorchLlmArgs, store: InMemoryBlockStore, *, load_async: bool = False,
                 save_async: bool = False, ignore_salt: bool = False):
        super().__init__(llm_args)
        self.store, self.load_async, self.save_async, self.ignore_salt = store, load_async, save_async, ignore_salt
        self.block = llm_args.kv_cache_config.tokens_per_block
        self._tracked: dict[int, _Tracked] = {}
        self._loads: list[Placement] = []
        self._async_loads: dict[int, list[Placement]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        salt = None if self.ignore_salt else request.cache_salt_id
        t = self._tracked[request.request_id] = _Tracked(salt, request.lora_task_id)
        if num_computed_tokens % self.block:
            return 0, False
        claimable = (request.prompt_len - 1) // self.block  # leave a prompt token to compute
        keys = chain_block_keys(request.get_tokens(0), self.block, claimable, t.salt, t.lora)
        first = i = num_computed_tokens // self.block
        while i < claimable and self.store.contains(keys[i]):
            t.loads.append((keys[i], i))
            i += 1
        t.external = (i - first) * self.block
        return t.external, self.load_async and t.external > 0

    def update_state_after_alloc(self, request, block_ids: list[int]) -> None:
        t = self._tracked[request.request_id]
        loads = [(key, block_ids[ordinal]) for key, ordinal in t.loads]
        if loads and self.load_async:
            self._async_loads[request.request_id] = loads
        else:
            self._loads.extend(loads)
        t.loads = []

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreMetadata:
        meta = StoreMetadata(self._loads, self._async_loads)
        self._loads, self._async_loads = [], {}
        for data in scheduler_output.new_requests:
            t = self._tracked[data.request_id]
            t.tokens, t.block_ids = list(data.new_tokens), list(data.new_block_ids)
            self._plan(data.request_id, t, data.computed_position + t.external + data.num_scheduled_tokens, meta)
        for data in scheduler_output.cached_requests:
            t = self._tracked[data.request_id]
            t.tokens += data.new_tokens
            t.block_ids += data.new_block_ids
            self._plan(data.request_id, t, data.computed_position + data.num_scheduled_tokens, meta)
        return meta

    def request_finished(self, request, cache_block_ids: list[int]) -> bool:
        t = self._tracked.pop(request.request_id, None)
        if t is None:
            return False
        assert list(cache_block_ids[:len(t.block_ids)]) == t.block_ids, "the blocks reported before"
        return self.save_async and t.has_plan

    def _plan(self, request_id: int, t: _Tracked, kv_after_pass: int, meta: StoreMetadata) -> None:
        # NOTE: max(): under the overlap scheduler a generation step reports one token less than
        # the context pass before it computed, so the reported position is not monotonic.
        t.kv_done = max(t.kv_done, kv_after_pass)
        full = min(t.kv_done, len(t.tokens)) // self.block
        if full <= t.planned:
            return
        keys = chain_block_keys(t.tokens, self.block, full, t.salt, t.lora)
        new = [(keys[i], t.block_ids[i]) for i in range(t.planned, full) if not self.store.contains(keys[i])]
        t.planned = full
        if not new:
            return
        if self.save_async:
            meta.save_plans[request_id] = new
            t.has_plan = True
        else:
            meta.saves.extend(new)


class StoreConnectorWorker(KvCacheConnectorWorker):
    """TEST DOUBLE (worker role) of an offloading connector; see the module doc."""

    def __init__(self, llm_args: TorchLlmArgs, store: InMemoryBlockStore):
        super().__init__(llm_args)
        self.rank = llm_args.parallel_config.to_mapping().rank
        self.store, self.kv = store, None
        self._plans: dict[int, list[Placement]] = {}
        self._loaded: set[int] = set()
        self._asked_loading: set[int] = set()
        self._saved: set[int] = set()

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        self.kv = kv_cache_tensor

    def start_load_kv(self, stream) -> None:
        meta: StoreMetadata = self.get_connector_meta()
        for key, block in meta.loads:
            self._load(key, block)
        for request_id, loads in meta.async_loads.items():
            for key, block in loads:
                self._load(key, block)
            self._loaded.add(request_id)
        for request_id, plan in meta.save_plans.items():
            self._plans.setdefault(request_id, []).extend(plan)

    def wait_for_layer_load(self, layer_idx: int, stream) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, stream) -> None:
        pass

    def wait_for_save(self, stream) -> None:
        if stream is not None:
            stream.synchronize()
        for key, block in self.get_connector_meta().saves:
            self._save(key, block)

    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]):
        self._asked_loading.update(started_loading_req_ids)
        done_saving, self._saved = sorted(self._saved), set()  # copied in an earlier call
        for request_id in finished_gen_req_ids:
            for key, block in self._plans.pop(request_id, []):
                self._save(key, block)
            self._saved.add(request_id)
        done_loading = sorted(self._loaded & self._asked_loading)
        self._loaded -= set(done_loading)
        self._asked_loading -= set(done_loading)
        return done_saving, done_loading

    def _load(self, key: int, block: int) -> None:
        self.kv[block].copy_(self.store.get(key, self.rank))

    def _save(self, key: int, block: int) -> None:
        self.store.put(key, self.rank, self.kv[block].to("cpu", copy=True))


class CorruptingConnectorWorker(StoreConnectorWorker):
    """TEST DOUBLE, negative control: every loaded block has the low bit of one element flipped."""

    def _load(self, key: int, block: int) -> None:
        super()._load(key, block)
        flat = self.kv[block].view(torch.int16).view(-1)
        index = key % flat.numel()
        flat[index] = flat[index] ^ 1


def store_connector(store: InMemoryBlockStore, *, load_async: bool = False, save_async: bool = False,
                    corrupt: bool = False, ignore_salt: bool = False) -> ConnectorFactories:
    """Factories of the store doubles sharing ``store``."""
    worker = CorruptingConnectorWorker if corrupt else StoreConnectorWorker
    return ConnectorFactories(partial(StoreConnectorScheduler, store=store, load_async=load_async,
                                      save_async=save_async, ignore_salt=ignore_salt),
                              partial(worker, store=store))
