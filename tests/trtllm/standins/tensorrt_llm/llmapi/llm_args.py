"""STAND-IN for ``tensorrt_llm.llmapi.llm_args``: the LLM API arguments a connector is
constructed with, reduced to the fields a KV cache connector reads. Tests only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from tensorrt_llm.mapping import Mapping


@dataclass(frozen=True)
class KvCacheConfig:
    """``kv_cache_config`` (the guide sets ``enable_partial_reuse: false``)."""

    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    tokens_per_block: int = 32
    free_gpu_memory_fraction: Optional[float] = None


@dataclass(frozen=True)
class KvCacheConnectorConfig:
    """``kv_connector_config``: the module imported with ``importlib.import_module`` and the
    names of the two classes in it."""

    connector_module: str
    connector_scheduler_class: str
    connector_worker_class: str


@dataclass(frozen=True)
class _ParallelConfig:
    """``parallel_config``. In TensorRT-LLM each rank is its own process and the rank comes from
    MPI; the stand-in carries it so the in-process ranks of ``tests/trtllm`` differ."""

    tp_size: int = 1
    rank: int = 0

    def to_mapping(self) -> Mapping:
        return Mapping(world_size=self.tp_size, rank=self.rank, tp_size=self.tp_size)


@dataclass(frozen=True)
class TorchLlmArgs:
    """``TorchLlmArgs`` (``backend: pytorch``), the connector constructors' only argument."""

    model: str = "standin-model"
    backend: str = "pytorch"
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    parallel_config: _ParallelConfig = field(default_factory=_ParallelConfig)
    kv_connector_config: Optional[KvCacheConnectorConfig] = None
    cuda_graph_config: Optional[object] = None
    disable_overlap_scheduler: bool = False
    max_batch_size: int = 8
    max_num_tokens: int = 8192

    def for_rank(self, rank: int) -> "TorchLlmArgs":
        """Stand-in only: the same arguments as seen by ``rank``'s process."""
        return replace(self, parallel_config=replace(self.parallel_config, rank=rank))
