"""The TensorRT-LLM names the connector subclasses, from whichever module path this release has.

Newer releases define the KV cache connector interface in
``tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector``; the v1.1 releases (the ones
the KVBM guide names, and Dynamo's connector imports) in
``tensorrt_llm._torch.pyexecutor.kv_cache_connector``. Both define the same two ABCs.
"""
from __future__ import annotations

# NOTE: TensorRT-LLM is absent where the type checker runs: its classes are Any there.
try:
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (  # type: ignore[import-not-found]
        KvCacheConnectorScheduler,
        KvCacheConnectorWorker,
        SchedulerOutput,
    )
except ImportError:  # a v1.1 release
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (  # type: ignore[import-not-found,no-redef]
        KvCacheConnectorScheduler,
        KvCacheConnectorWorker,
        SchedulerOutput,
    )

__all__ = ["KvCacheConnectorScheduler", "KvCacheConnectorWorker", "SchedulerOutput"]
