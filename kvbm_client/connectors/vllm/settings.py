"""Connector settings: ``kv_connector_extra_config`` first, then the ``DYN_KVBM_*``
environment (the same defaults as ``kvbm serve``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...config import KvbmConfig, parse_bool


@dataclass(frozen=True)
class ConnectorSettings:
    leader_address: str
    worker_address_template: str  # "{id}" is replaced by the worker id
    namespace: str
    timeout_s: float
    retry_s: float
    ready_timeout_s: float = 120.0
    #: "sync": a hit is loaded in the step that computes the rest of the prompt (the engine
    #: waits for the copy; one step less, the lowest TTFT). "async": the request waits in
    #: WAITING_FOR_REMOTE_KVS while other requests keep running (no stall of their decodes).
    load_mode: str = "sync"
    #: the scheduler role starts a hit's copy on the worker daemons as soon as vLLM allocated
    #: its blocks (see :mod:`.early_loads`); false: the worker role starts it before the forward.
    early_loads: bool = True
    #: the node's settings as this engine sees them (channels: TLS, tokens, message sizes)
    config: KvbmConfig = field(default_factory=KvbmConfig)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], default_namespace: str) -> "ConnectorSettings":
        overrides = {k: extra[k] for k in ("socket_dir", "leader_address") if extra.get(k)}
        cfg = KvbmConfig.from_env(**overrides)
        template = extra.get("worker_address") or cfg.worker_address("{id}")
        return cls(config=cfg, leader_address=cfg.resolved_leader_address, worker_address_template=template,
                   namespace=str(extra.get("namespace") or default_namespace),
                   timeout_s=float(extra.get("timeout_s", 2.0)), retry_s=float(extra.get("retry_s", 2.0)),
                   ready_timeout_s=float(extra.get("ready_timeout_s", 120.0)),
                   load_mode=_load_mode(extra.get("load_mode", "sync")),
                   early_loads=_flag("early_loads", extra.get("early_loads", True)))

    @property
    def sync_loads(self) -> bool:
        return self.load_mode == "sync"

    def worker_address(self, worker_id: str) -> str:
        return self.worker_address_template.replace("{id}", worker_id)


LOAD_MODES = ("sync", "async")


def _load_mode(value: Any) -> str:
    mode = str(value).lower()
    if mode not in LOAD_MODES:
        raise ValueError(f"kv_connector_extra_config.load_mode={value!r}: one of {', '.join(LOAD_MODES)}")
    return mode


def _flag(name: str, value: Any) -> bool:
    try:
        return parse_bool(value)
    except ValueError:
        raise ValueError(f"kv_connector_extra_config.{name}={value!r}: true or false") from None


class Backoff:
    """Circuit breaker for an unreachable service: try at most once per ``period``."""

    def __init__(self, period: float) -> None:
        self.period = period
        self._next = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self._next

    def failed(self) -> None:
        self._next = time.monotonic() + self.period

    def reset(self) -> None:
        self._next = 0.0
