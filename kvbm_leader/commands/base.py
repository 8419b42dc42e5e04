"""The command contract: how the leader hands a signed plan to one worker and learns the result.

Runs in the leader, on its event loop. Protocol:

    send(worker, request, timeout, accept) -> CommandAck   deliver a ``CommandRequest`` (a
                                                            signed plan) and wait for the
                                                            worker's acknowledgement
    forget(worker_id)                                       drop per-worker state (it left)
    close()                                                 idempotent

Invariant: ``CommandAck.delivered`` is True only when the worker answered and ``accept`` (the
caller's check of the worker's signature, :func:`kvbm_client.security.ack_is_authentic`) took
its answer. A reply that fails the check is not the worker's word: it is counted in
``CommandAck.forged`` and ignored (on NATS the transport goes on waiting for the genuine
reply). When ``delivered`` is False the outcome is unknown (the worker may still be copying),
so the caller must not free the job's slots before the job expires (see :mod:`kvbm_leader.jobs`).

Transports are registered by name and imported lazily (``grpc`` is the default; ``nats``
needs nats-py and ``NATS_SERVER``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from kvbm_client.contract import pb
from kvbm_client.ids import WorkerId

from ..membership import WorkerRecord

#: The caller's check of a worker's acknowledgement (its signature, worker and job).
AckCheck = Callable[["pb.CommandResponse"], bool]


@dataclass(frozen=True, slots=True)
class CommandAck:
    delivered: bool  # the worker answered (ok or not); False: lost, timed out, no route
    ok: bool = False
    error: str = ""
    forged: int = 0  # replies refused by the caller's check (not signed by the worker)


class CommandTransport:
    """Base class of the transports; see the module docstring."""

    name = ""

    async def send(self, worker: WorkerRecord, request: "pb.CommandRequest", timeout: float,
                   accept: AckCheck) -> CommandAck:
        raise NotImplementedError

    def forget(self, worker_id: WorkerId) -> None:
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
    transport: CommandTransport = getattr(importlib.import_module(module_path), class_name)(**kwargs)
    return transport


register("grpc", "kvbm_leader.commands.grpc", "GrpcCommands")
register("nats", "kvbm_leader.commands.nats", "NatsCommands")
