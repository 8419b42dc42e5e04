"""vLLM v1 KV connector for kvbm.

    --kv-transfer-config '{"kv_connector":"KvbmConnector",
                           "kv_connector_module_path":"kvbm_client.connectors.vllm",
                           "kv_role":"kv_both","kv_load_failure_policy":"recompute"}'

``KvbmConnector`` is imported on first use (vLLM's factory does ``getattr`` on this module),
so the submodules that do not need vLLM import without it.
"""
from __future__ import annotations

__all__ = ["KvbmConnector"]


def __getattr__(name: str):
    if name == "KvbmConnector":
        from .connector import KvbmConnector
        return KvbmConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
