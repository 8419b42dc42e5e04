"""A KV connector that does nothing: what vLLM's own connector machinery costs a request.

The cold target of issue 13 (a request with no hit within 2 % of vLLM without a connector)
compares kvbm with vLLM run with no ``kv_transfer_config`` at all. Every connector measured there
was slower cold than that (20K eager, H100, 2026-11-26 thirteenth session: native +6 %, LMCache
+19 %, Dynamo +9 %, kvbm +2.4 %). This connector finds no hit, plans nothing, loads and stores
nothing, and returns at once from every hook; the harness system ``null`` (``vllm_peers.py``) runs
it beside vLLM alone and kvbm in one run (runbook steps ``coldnull20``, ``coldwhy20``). Measured
there (machine u): +0.1 % cold, so vLLM's connector paths are not what kvbm's cold gap is made of.

With ``KVBM_CONNECTOR_TRACE`` set it also writes the engine's step timeline into the connector
trace (``kvbm_client.connectors.core.tracing``, the same file as kvbm's), which vLLM alone cannot:
``null_lookup`` (scheduler: a request asked about), ``null_step`` (scheduler: a step planned, its
scheduled tokens), ``null_forward`` (worker: ``start_load_kv`` to ``wait_for_save``, wall and CPU ms,
the forward enqueued). ``ttft_breakdown.py`` lines them up with kvbm's (its cold table).

vLLM loads ``NullConnector`` from this module (``kv_connector_module_path``
``benchmarks.null_connector``); the class is built on first use, so importing the module does
not need vLLM.
"""
from __future__ import annotations

import time
from typing import Any

from kvbm_client.connectors.core.tracing import trace, tracing


def _build() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class NullConnector(KVConnectorBase_V1):
        """No hit, no plan, no copy: each hook returns at once (traced: see the module)."""

        _forward_from: tuple[float, float] | None = None

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            if tracing():
                trace("null_lookup", req=str(getattr(request, "request_id", "")))
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            return None

        def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
            if tracing():
                trace("null_step", tokens=int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0))
            return KVConnectorMetadata()

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            self._forward_from = (time.perf_counter(), time.thread_time()) if tracing() else None

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None

        def wait_for_save(self) -> None:
            since, self._forward_from = self._forward_from, None
            if since is not None:
                trace("null_forward", ms=round((time.perf_counter() - since[0]) * 1e3, 2),
                      cpu_ms=round((time.thread_time() - since[1]) * 1e3, 2))

    return NullConnector


def __getattr__(name: str) -> type:
    if name == "NullConnector":
        cls = _build()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
