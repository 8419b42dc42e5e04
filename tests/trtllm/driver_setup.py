"""How the driver is set up: the engine it replays and how it builds the connector roles."""
from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs, _ParallelConfig

from .kv_model import KvGeometry


@dataclass(frozen=True)
class DriverConfig:
    """The engine being replayed.

    Attributes:
        num_blocks: Device blocks per rank (small pools make the device forget prefixes).
        overlap_scheduler: TensorRT-LLM's default; sampled tokens reach the request (and finished
            requests reach ``request_finished``) one iteration later.
        honour_delayed_free: False frees the blocks right after ``request_finished`` returned True
            and poisons them, as if another request reused them at once; only for the negative
            control of the delayed-free check.
        max_retries: Resubmissions of a request failed by a raising connector hook.
    """

    geometry: KvGeometry = field(default_factory=KvGeometry)
    num_blocks: int = 64
    max_batch_size: int = 8
    max_num_tokens: int = 4096
    enable_chunked_prefill: bool = False
    enable_block_reuse: bool = True
    overlap_scheduler: bool = False
    device: str = "cpu"
    vocab_size: int = 1000
    tenant_sensitive_kv: bool = True
    verify: bool = True
    honour_delayed_free: bool = True
    max_retries: int = 0
    stall_timeout_s: float = 60.0
    idle_sleep_s: float = 0.001

    def llm_args(self, connector_config: Optional[KvCacheConnectorConfig] = None) -> TorchLlmArgs:
        """The LLM API arguments of the guide's YAML (partial reuse off, no CUDA graphs)."""
        kv = KvCacheConfig(enable_block_reuse=self.enable_block_reuse, enable_partial_reuse=False,
                           tokens_per_block=self.geometry.tokens_per_block)
        return TorchLlmArgs(kv_cache_config=kv, parallel_config=_ParallelConfig(tp_size=self.geometry.tp_size),
                            kv_connector_config=connector_config, cuda_graph_config=None,
                            disable_overlap_scheduler=not self.overlap_scheduler,
                            max_batch_size=self.max_batch_size, max_num_tokens=self.max_num_tokens)


@dataclass(frozen=True)
class ConnectorFactories:
    """How to build the connector roles from ``llm_args`` (the scheduler on rank 0, a worker per
    rank, all constructed concurrently as ``py_executor_creator`` does)."""

    scheduler: Callable[[TorchLlmArgs], object]
    worker: Callable[[TorchLlmArgs], object]
    config: Optional[KvCacheConnectorConfig] = None

    @classmethod
    def from_config(cls, config: KvCacheConnectorConfig) -> "ConnectorFactories":
        """Import ``connector_module`` and look the classes up by name, like TensorRT-LLM."""
        module = importlib.import_module(config.connector_module)
        return cls(getattr(module, config.connector_scheduler_class),
                   getattr(module, config.connector_worker_class), config)


def construct_connectors(factories: ConnectorFactories, llm_args: TorchLlmArgs, tp_size: int):
    """Scheduler (rank 0) and workers (every rank), constructed concurrently."""
    with ThreadPoolExecutor(max_workers=tp_size + 1) as pool:
        workers = [pool.submit(factories.worker, llm_args.for_rank(r)) for r in range(tp_size)]
        scheduler = pool.submit(factories.scheduler, llm_args.for_rank(0))
        return scheduler.result(), [w.result() for w in workers]
