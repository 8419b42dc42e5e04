"""Commands over NATS request/reply on ``kvbm.v1.commands.<node>.<worker>``; the reply is the
worker's acknowledgement (a serialized ``CommandResponse``).

Runs in the leader. While NATS is down a command is not delivered (``CommandAck.delivered``
False) and its job expires; nats-py reconnects by itself.
"""
from __future__ import annotations

import asyncio

from kvbm_client.bus import NatsBus, commands_subject
from kvbm_client.contract import pb

from ..membership import WorkerRecord
from .base import CommandAck, CommandTransport


class NatsCommands(CommandTransport):
    name = "nats"

    def __init__(self, bus: NatsBus, node: str) -> None:
        self.bus = bus
        self.node = node

    async def send(self, worker: WorkerRecord, request: "pb.CommandRequest", timeout: float) -> CommandAck:
        if not self.bus.is_connected:
            return CommandAck(False, False, "NATS is not connected")
        import nats.errors

        try:
            msg = await self.bus.nc.request(commands_subject(self.node, worker.worker_id),
                                            request.SerializeToString(), timeout=timeout)
        except nats.errors.NoRespondersError:
            # Nobody subscribed: the worker never received it, so nothing can be copying.
            return CommandAck(True, False, f"no worker {worker.worker_id} subscribed on NATS")
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            return CommandAck(False, False, f"{type(exc).__name__}: {exc}")
        resp = pb.CommandResponse()
        resp.ParseFromString(msg.data)
        return CommandAck(True, resp.ok, resp.error, resp)
