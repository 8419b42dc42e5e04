"""The command contract: how the leader hands a signed plan to one worker and learns the result.

Runs in the leader, on its event loop. Protocol:

    send(worker, request, timeout) -> CommandAck   deliver a ``CommandRequest`` (a signed plan)
                                                   and wait for the worker's acknowledgement
    forget(worker_id)                               drop per-worker state (the worker left)
    close()                                         idempotent

Invariant: ``CommandAck.delivered`` is True only when the worker answered. When it is False
the outcome is unknown (the worker may still be copying), so the caller must not free the
job's slots before the job expires (see :mod:`kvbm_leader.jobs`).

Transports are registered by name and imported lazily (``grpc`` is the default; ``nats``
needs nats-py and ``NATS_SERVER``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from kvbm_client.contract import pb

from ..membership import WorkerRecord


@dataclass(frozen=True, slots=True)
class CommandAck:
    delivered: bool  # the worker answered (ok or not); False: lost, timed out, no route
    ok: bool = False
    error: str = ""
    #: the worker's own answer, when it sent one: its signature must be checked
    #: (:func:`kvbm_client.security.ack_is_authentic`) before ``ok`` is believed
    response: "pb.CommandResponse | None" = None


class CommandTransport:
    """Base class of the transports; see the module docstring."""

    name = ""

    async def send(self, worker: WorkerRecord, request: "pb.CommandRequest", timeout: float) -> CommandAck:
        raise NotImplementedError

    def forget(self, worker_id: str) -> None:
        """Called when a worker detaches."""

    async def close(self) -> None:
        """Release connections; idempotent."""


_REGISTRY: dict[str, tuple[str, str]] = {}


def register(name: str, module_path: str, class_name: str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"command transport {name!r} is already registered")
    _REGISTRY[name] = (module_path, class_name)


def create(name: str, **kwargs: Any) -> CommandTransport:
    if name not in _REGISTRY:
        raise ValueError(f"unknown command transport {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    module_path, class_name = _REGISTRY[name]
    return getattr(importlib.import_module(module_path), class_name)(**kwargs)


register("grpc", "kvbm_leader.commands.grpc", "GrpcCommands")
register("nats", "kvbm_leader.commands.nats", "NatsCommands")
