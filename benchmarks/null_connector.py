"""A KV connector that does nothing: what vLLM's own connector machinery costs a request.

The cold target of issue 13 (a request with no hit within 2 % of vLLM without a connector)
compares kvbm with vLLM run with no ``kv_transfer_config`` at all. Every connector measured there
was slower cold than that (20K eager, H100, 2026-11-26 thirteenth session: native +6 %, LMCache
+19 %, Dynamo +9 %, kvbm +2.4 %). This connector finds no hit, plans nothing, loads and stores
nothing, and returns at once from every hook; the harness system ``null`` (``vllm_peers.py``) runs
it, so the part of the cold gap that any connector pays (vLLM's scheduling and model-runner
paths with a connector, its per-layer hook calls) is measured beside vLLM alone and kvbm in one
run (runbook step ``coldnull20``).

vLLM loads ``NullConnector`` from this module (``kv_connector_module_path``
``benchmarks.null_connector``); the class is built on first use, so importing the module does
not need vLLM.
"""
from __future__ import annotations

from typing import Any


def _build() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class NullConnector(KVConnectorBase_V1):
        """No hit, no plan, no copy: each hook returns at once."""

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            return None

        def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
            return KVConnectorMetadata()

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            return None

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None

        def wait_for_save(self) -> None:
            return None

    return NullConnector


def __getattr__(name: str) -> type:
    if name == "NullConnector":
        cls = _build()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
