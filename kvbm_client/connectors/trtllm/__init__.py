"""TensorRT-LLM KV cache connector for kvbm (PyTorch backend).

The LLM API config (``trtllm-serve MODEL --backend pytorch --extra_llm_api_options FILE``)::

    backend: pytorch
    cuda_graph_config: null
    kv_cache_config:
      enable_partial_reuse: false
    kv_connector_config:
      connector_module: kvbm_client.connectors.trtllm
      connector_scheduler_class: KvbmConnectorScheduler
      connector_worker_class: KvbmConnectorWorker

Two thin adapters over the engine-independent core (:mod:`..core`), which the vLLM connector
shares: :class:`.scheduler.KvbmConnectorScheduler` (rank 0) and :class:`.worker.KvbmConnectorWorker`
(every rank). Written against TensorRT-LLM's ``KvCacheConnectorScheduler`` /
``KvCacheConnectorWorker`` as of NVIDIA/TensorRT-LLM commit
``035ab91cad04b7b77a479a9526edecfbc742c661`` (``_torch/pyexecutor/connectors/kv_cache_connector.py``;
v1.1 path at ``00fdcbff5ad82a6438b3e0c9dbc5480b6ee52bdc``) and the executor loop of
``py_executor.py`` at ``0004396720054fd8e205cbf616f21f0b57c6b412``; ``tests/trtllm/TRTLLM_API.md``
lists the rules followed, with citations.

The classes are imported on first use (TensorRT-LLM does ``getattr`` on this module), so the
submodules that do not need TensorRT-LLM import without it.
"""
from __future__ import annotations

__all__ = ["KvbmConnectorScheduler", "KvbmConnectorWorker"]


def __getattr__(name: str):
    if name == "KvbmConnectorScheduler":
        from .scheduler import KvbmConnectorScheduler
        return KvbmConnectorScheduler
    if name == "KvbmConnectorWorker":
        from .worker import KvbmConnectorWorker
        return KvbmConnectorWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
