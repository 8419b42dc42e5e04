"""Where a peer connector's time goes inside vLLM: LMCache's hooks timed from the engine's side
(the harness system ``lmcache_timed``, ``vllm_peers.py``), into the connector trace file.

vLLM loads ``TimedLMCacheConnectorV1`` from this module (``kv_connector_module_path``
``benchmarks.peer_timing``): LMCache 0.5.3's connector unchanged, each hook wrapped in
:class:`TimedHooks`, which appends to ``$KVBM_CONNECTOR_TRACE`` (the same file and format as
kvbm's own trace, ``kvbm_client.connectors.core.tracing``):

* ``peer_lookup`` (scheduler process): ``get_num_new_matched_tokens``, ms;
* ``peer_meta`` (scheduler process): ``build_connector_meta``, ms;
* ``peer_load`` (worker process): ``start_load_kv``, ms and the thread's CPU ms (LMCache's
  default loads the hit there, synchronously);
* ``peer_forward`` (worker process): from ``start_load_kv``'s return to ``wait_for_save``, ms
  and CPU ms (the forward enqueued), for steps that loaded;
* ``peer_save`` (worker process): ``wait_for_save``, ms.

Why: LMCache's warm 20K TTFT on the H200 (69-80 ms, 2026-11-26) is less than the sum of kvbm's
measured front end, a full copy and an eager forward's CPU time (~100 ms), although its default
path copies synchronously in ``start_load_kv`` (``load_stream.synchronize()``); this says which
of those it does not pay. ``ttft_breakdown.py`` prints these per warm request.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from kvbm_client.connectors.core.tracing import trace, tracing


def _timed(what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, its wall time traced as ``what`` (ms) however it ends."""
    t0 = time.perf_counter()
    try:
        return call(*args, **kwargs)
    finally:
        if tracing():
            trace(what, ms=round((time.perf_counter() - t0) * 1e3, 3))


class TimedHooks:
    """Mixin in front of a vLLM KV connector: times its hooks into the connector trace."""

    _forward_from: tuple[float, float] | None = None

    def get_num_new_matched_tokens(self, *args: Any, **kwargs: Any) -> Any:
        return _timed("peer_lookup", super().get_num_new_matched_tokens, *args, **kwargs)  # type: ignore[misc]

    def build_connector_meta(self, *args: Any, **kwargs: Any) -> Any:
        return _timed("peer_meta", super().build_connector_meta, *args, **kwargs)  # type: ignore[misc]

    def start_load_kv(self, *args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return super().start_load_kv(*args, **kwargs)  # type: ignore[misc]
        finally:
            t1, c1 = time.perf_counter(), time.thread_time()
            self._forward_from = (t1, c1)
            if tracing():
                trace("peer_load", ms=round((t1 - t0) * 1e3, 3), cpu_ms=round((c1 - c0) * 1e3, 3))

    def wait_for_save(self, *args: Any, **kwargs: Any) -> Any:
        since, self._forward_from = self._forward_from, None
        t0, c0 = time.perf_counter(), time.thread_time()
        if since is not None and tracing():
            trace("peer_forward", ms=round((t0 - since[0]) * 1e3, 3), cpu_ms=round((c0 - since[1]) * 1e3, 3))
        return _timed("peer_save", super().wait_for_save, *args, **kwargs)  # type: ignore[misc]


def timed(base: type) -> type:
    """``base`` with its hooks timed (:class:`TimedHooks` first in the MRO)."""
    return type(f"Timed{base.__name__}", (TimedHooks, base), {})


def __getattr__(name: str) -> type:
    """vLLM's connector factory asks this module for the class by name: built on first use,
    so that importing the module needs neither vLLM nor LMCache."""
    if name == "TimedLMCacheConnectorV1":
        from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1
        cls = timed(LMCacheConnectorV1)
        globals()[name] = cls
        return cls
    raise AttributeError(name)
