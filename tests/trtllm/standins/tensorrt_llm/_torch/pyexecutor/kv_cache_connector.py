"""STAND-IN for ``tensorrt_llm._torch.pyexecutor.kv_cache_connector``, the module path of the
v1.1 releases (the one Dynamo's KVBM connector imports). Newer releases moved it to
``tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector``; both paths name the same classes.
"""
from .connectors.kv_cache_connector import (  # noqa: F401
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    RequestData,
    SchedulerOutput,
)
