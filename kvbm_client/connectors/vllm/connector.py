"""``KvbmConnector``: vLLM's ``KVConnectorBase_V1``, a role facade.

The scheduler role (:class:`.scheduler.KvbmConnectorScheduler`) talks to the leader; the
worker role (:class:`.worker.KvbmConnectorWorker`) talks to its worker daemon. Both are thin
translations of vLLM's hooks over the engine-independent core (:mod:`..core`), which the
TensorRT-LLM connector shares. The roles share no state: the scheduler's decisions reach
workers only as :class:`.metadata.KvbmConnectorMetadata`.

Supported vLLM: 0.26 - 0.32 (see :mod:`.compat`).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

try:  # the hybrid KV cache manager's interface (vLLM 0.26 and later)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM
    class SupportsHMA:  # type: ignore[no-redef]
        """Stands in where vLLM has no hybrid KV cache manager."""

from ...ids import EngineBlockId
from ...logs import attach_engine_logging
from ..core.settings import ConnectorSettings, LoadMode, configured_load_mode, worker_ids
from ..core.tracing import trace_collections
from . import compat
from .metadata import KvbmConnectorMetadata
from .scheduler import KvbmConnectorScheduler
from .worker import KvbmConnectorWorker, region_from_kv_caches

log = logging.getLogger("kvbm.connector")


class KvbmConnector(KVConnectorBase_V1, SupportsHMA):
    """The role facade vLLM loads (one per role: scheduler in the EngineCore, worker per rank).

    NOTE: it declares ``SupportsHMA`` so that vLLM keeps the hybrid KV cache manager on when
    kvbm is composed with other connectors (``MultiConnector`` turns it off unless every child
    supports it, and NIXL's handshake then fails between a prefill engine with kvbm and a
    decode engine without). kvbm moves the blocks of one KV cache group: an engine with
    several groups (a hybrid model) runs without kvbm, with a warning.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        attach_engine_logging()
        trace_collections()
        compat.check_version()
        ktc = vllm_config.kv_transfer_config
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        # NOTE: engine_id is the same in the scheduler and worker processes of one engine (vLLM
        # pickles the config to its workers); the scheduler finds its worker's region ids by it.
        auto_mode, why = compat.auto_load_mode(vllm_config)
        self._settings = ConnectorSettings.from_extra(extra, compat.namespace(vllm_config),
                                                      engine_id=str(ktc.engine_id or ""),
                                                      auto_load_mode=LoadMode(auto_mode))
        if self._settings.load_mode is LoadMode.LAYERWISE:
            fit = compat.layerwise_graph_fit(vllm_config)
            if fit is None:
                log.warning("kvbm: load_mode layerwise needs vLLM's layer hooks, which cudagraph_mode FULL never runs; "
                            "loading %s instead (FULL_AND_PIECEWISE, vLLM's default, keeps layerwise)", auto_mode)
                self._settings = replace(self._settings, load_mode=LoadMode(auto_mode))
            else:
                self._settings = replace(self._settings, min_computed_tokens=fit)
        if configured_load_mode(extra) is LoadMode.AUTO:
            # NOTE: a warning when auto gives up the faster synchronous loads: the operator should
            # know why hits cost one engine step more (vLLM's engine process shows warnings only)
            (log.warning if auto_mode == LoadMode.ASYNC.value else log.info)(
                "kvbm: load_mode auto -> %s (%s)", auto_mode, why)
        groups = compat.kv_cache_groups(kv_cache_config)
        #: False for an engine kvbm cannot serve (several KV cache groups): every hook is neutral
        self._enabled = groups <= 1
        if not self._enabled:
            log.warning("kvbm: this engine has %d KV cache groups (a hybrid model); kvbm serves models "
                        "with one group, so this engine runs without kvbm", groups)
        self._block_size = vllm_config.cache_config.block_size
        self._scheduler: KvbmConnectorScheduler | None = None
        self._worker: KvbmConnectorWorker | None = None
        self._shm: Any = None
        if role == KVConnectorRole.SCHEDULER:
            workers = worker_ids(extra, compat.tensor_parallel_size(vllm_config))
            self._scheduler = KvbmConnectorScheduler(self._block_size, self._settings, workers,
                                                     overlapping_steps=compat.overlapping_steps(vllm_config),
                                                     defers_block_frees=compat.defers_block_frees(vllm_config))
        else:
            self._rank = compat.worker_rank(vllm_config)
            overlapping = compat.overlapping_steps(vllm_config)
            self._worker = KvbmConnectorWorker(str(extra.get("worker_id", self._rank)), self._settings, overlapping,
                                               ordered_loads=overlapping > 1 and not compat.defers_block_frees(
                                                   vllm_config))

    # ==== properties ====
    @property
    def _worker_role(self) -> KvbmConnectorWorker:
        assert self._worker is not None, "a worker-side hook called on the scheduler's connector"
        return self._worker

    @property
    def _scheduler_role(self) -> KvbmConnectorScheduler:
        assert self._scheduler is not None, "a scheduler-side hook called on a worker's connector"
        return self._scheduler

    @property
    def requires_kv_delivery(self) -> bool:  # a best-effort cache: never hold requests for it
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any] | None) -> bool:
        """No, layer-pipelined loads included: FULL CUDA graphs skip the layer hooks (vllm#29608),
        but vLLM's default runs them only for uniform decode batches, which a load's step never
        is (``compat.layerwise_graph_fit``); declaring it would make every decode step PIECEWISE."""
        return False

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """vLLM 0.26 (GPU): ask for one cross-layer buffer, so a block is one contiguous run
        (unless ``cross_layer_blocks`` is false)."""
        return compat.is_cuda(self._vllm_config) and self._settings.cross_layer_blocks

    # ==== Worker-side methods ====
    def get_mem_pool_context(self):
        """vLLM >= 0.32: allocate the (CPU) KV cache in a sealed memfd the daemon can be handed."""
        if compat.is_cuda(self._vllm_config):
            return None
        from .shm_kv import ShmKvAllocation
        self._shm = ShmKvAllocation(self._rank)
        return self._shm

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if compat.is_cuda(self._vllm_config):
            self._register_gpu(list(kv_caches.values()), compat.names_by_tensor(kv_caches))
            return
        shm = self._shm
        spec = region_from_kv_caches(kv_caches, shm.fd if shm and shm.tensor is not None else None,
                                     shm.tensor if shm else None)
        self._worker_role.set_region(spec, names_by_tensor=[[name] for name in kv_caches])

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend=None) -> None:
        """vLLM 0.26 with ``prefer_cross_layer_blocks``: one buffer for every layer (exported one
        page per layer for layer-pipelined loads, else one page per block)."""
        names = compat.cross_layer_names(getattr(self, "_kv_cache_config", None))
        split = self._settings.load_mode is LoadMode.LAYERWISE and compat.layers_follow_blocks(attn_backend)
        if self._settings.load_mode is LoadMode.LAYERWISE and not split:
            log.warning("kvbm: this KV cache layout does not keep each layer's part of a block together "
                        "(attention backend %s); layer-pipelined loads wait for the whole load",
                        getattr(attn_backend, "__name__", attn_backend))
        self._register_gpu([kv_cache], names, layer_pages=len(names) if split else 0)

    def _register_gpu(self, tensors: list, names_by_tensor: list[list[str]], layer_pages: int = 0) -> None:
        if not self._enabled:
            return
        try:
            spec = compat.gpu_region_spec(tensors, layer_pages)
            compat.check_block_count(spec.num_blocks, getattr(self, "_kv_cache_config", None))
        except ValueError as exc:
            log.warning("kvbm: cannot export the engine's KV cache (%s); serving without kvbm", exc)
            spec = None
        self._worker_role.set_region(spec, cuda=True, names_by_tensor=names_by_tensor)

    def handle_preemptions(self, kv_connector_metadata=None, *args, **kwargs) -> None:
        self._worker_role.fence_if_needed(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata) -> None:
        if self._worker is not None:
            self._worker_role.bind(connector_metadata)
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._meta()
        if meta is not None:
            self._worker_role.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is not None:
            self._worker_role.start_stores(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._enabled:
            return None, None
        return self._worker_role.finished(self._meta())

    def get_block_ids_with_load_errors(self) -> set[EngineBlockId]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def _meta(self) -> KvbmConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KvbmConnectorMetadata) else None

    # ==== Scheduler-side methods ====
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._enabled:
            return 0, False
        return self._scheduler_role.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._enabled:
            self._scheduler_role.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KvbmConnectorMetadata:
        if not self._enabled:
            return KvbmConnectorMetadata()
        return self._scheduler_role.build_connector_meta(scheduler_output)

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        """vLLM >= 0.26 hands the scheduler role its block pool: stores pin their blocks there
        and finished requests are freed at once (``hold_stored_blocks``; else delayed frees)."""
        if self._enabled and self._scheduler is not None and self._settings.hold_stored_blocks:
            self._scheduler.bind_block_pool(gpu_block_pool, compat.world_size(self._vllm_config))

    def has_pending_push_work(self) -> bool:
        return self._enabled and self._scheduler is not None and self._scheduler.has_pending_push_work()

    def build_connector_worker_meta(self):
        return self._worker.worker_metadata() if self._enabled and self._worker is not None else None

    def update_connector_output(self, connector_output) -> None:
        super().update_connector_output(connector_output)
        if self._enabled:
            self._scheduler_role.update_connector_output(connector_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        if not self._enabled:
            return False, None
        return self._scheduler_role.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """vLLM's hybrid-manager form of :meth:`request_finished` (one list per KV cache group;
        kvbm serves engines with one group)."""
        if not self._enabled or len(block_ids) != 1:
            return False, None
        return self.request_finished(request, block_ids[0])

    # ==== Both ====
    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
        if self._shm is not None:
            self._shm.close()
