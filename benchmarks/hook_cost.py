"""What a KV connector's hooks cost vLLM's engine thread, step by step (the harness's ``*_hooks``
systems, ``peer_systems.py``): the same connector, every hook it has timed and summed.

vLLM calls a connector's hooks on the engine's own thread: the scheduler's (lookups, the step's
metadata, its outputs) and the model runner's (binding the metadata, the loads, a wait and a save
per layer, the step's end). Under eager mode a decode step is bound by that thread's CPU, so what
the hooks take adds to every token's time. vLLM loads ``Costed<Name>`` from this module
(``kv_connector_module_path`` ``benchmarks.hook_cost``): connector ``<Name>`` (:data:`ORIGINS`)
with each hook of :data:`HOOKS` it has wrapped. Every :data:`REPORT_EVERY` steps of a role (its
``build_connector_meta`` on the scheduler side, ``wait_for_save`` on the worker side) one
``hook_cost`` line goes into ``$KVBM_CONNECTOR_TRACE`` (kvbm's trace file and format): per hook,
the calls and the milliseconds so far, and the seconds since the role's first hook. What it does
not see: the connector's own threads, which take the interpreter lock from the engine's thread
between hooks.
"""
from __future__ import annotations

import importlib
import time
from typing import Any, Callable

from kvbm_client.connectors.core.tracing import trace, tracing

#: vLLM's KV connector hooks (``KVConnectorBase_V1``), the scheduler's and the worker's
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "has_pending_push_work", "bind_connector_metadata", "clear_connector_metadata",
         "handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
         "get_finished", "get_block_ids_with_load_errors", "build_connector_worker_meta")
#: a role's step: the hook called once per step on its side
STEP_HOOKS = ("build_connector_meta", "wait_for_save")
REPORT_EVERY = 32
#: the connectors this module wraps: class name -> module
ORIGINS = {"KvbmConnector": "kvbm_client.connectors.vllm",
           "LMCacheConnectorV1": "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector",
           "NullConnector": "benchmarks.null_connector"}


class Costs:
    """Calls and seconds per hook of one connector instance (one role)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.since: float | None = None

    def add(self, hook: str, seconds: float, now: float) -> None:
        if self.since is None:
            self.since = now - seconds
        self.calls[hook] = self.calls.get(hook, 0) + 1
        self.seconds[hook] = self.seconds.get(hook, 0.0) + seconds
        if hook in STEP_HOOKS and self.calls[hook] % REPORT_EVERY == 0 and tracing():
            trace("hook_cost", role="scheduler" if hook == "build_connector_meta" else "worker",
                  steps=self.calls[hook], since_s=round(now - self.since, 3), calls=dict(self.calls),
                  ms={k: round(v * 1e3, 3) for k, v in self.seconds.items()})


def _wrapped(name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            now = time.perf_counter()
            costs = self.__dict__.get("_hook_costs")
            if costs is None:
                costs = self.__dict__["_hook_costs"] = Costs()
            costs.add(name, now - t0, now)
    hook.__name__ = name
    return hook


#: vLLM's base class of KV connectors: its default hooks are not wrapped (vLLM may tell a
#: connector's own hook from the default by identity)
VLLM_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


def own_hooks(base: type) -> list[str]:
    """The :data:`HOOKS` that ``base`` or a class above it other than vLLM's base defines."""
    out = []
    for name in HOOKS:
        owner = next((c for c in base.__mro__ if name in c.__dict__), None)
        if owner is not None and owner.__module__ != VLLM_BASE and callable(getattr(base, name)):
            out.append(name)
    return out


def costed(base: type) -> type:
    """``base`` with each of its own hooks (:func:`own_hooks`) timed into a :class:`Costs` per instance."""
    hooks = {name: _wrapped(name, getattr(base, name)) for name in own_hooks(base)}
    return type(f"Costed{base.__name__}", (base,), hooks)


def __getattr__(name: str) -> type:
    """vLLM's connector factory asks for ``Costed<Name>``: built on first use, so that importing
    this module needs neither vLLM nor the connector."""
    if name.startswith("Costed") and name[len("Costed"):] in ORIGINS:
        base_name = name[len("Costed"):]
        cls = costed(getattr(importlib.import_module(ORIGINS[base_name]), base_name))
        globals()[name] = cls
        return cls
    raise AttributeError(name)
