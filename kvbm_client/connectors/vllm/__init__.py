"""vLLM v1 KV connector for kvbm.

    --kv-transfer-config '{"kv_connector":"KvbmConnector",
                           "kv_connector_module_path":"kvbm_client.connectors.vllm",
                           "kv_role":"kv_both","kv_load_failure_policy":"recompute"}'
"""
from .connector import KvbmConnector

__all__ = ["KvbmConnector"]
