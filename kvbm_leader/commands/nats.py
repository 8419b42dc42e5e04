"""Commands over NATS request/reply on ``kvbm.v1.commands.<node>.<worker>``; a reply is a
worker's acknowledgement (a serialized, signed ``CommandResponse``).

Runs in the leader. Any NATS client allowed on the subject can reply, so the first reply is
not trusted: the transport collects replies on its own inbox until one passes the caller's
signature check, or the timeout passes. A forged reply neither commits the job nor hides
the genuine one. While NATS is down a command is not delivered (``CommandAck.delivered``
False) and its job expires; nats-py reconnects by itself.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvbm_client.bus import NatsBus, commands_subject
from kvbm_client.contract import pb

from ..membership import WorkerRecord
from .base import AckCheck, CommandAck, CommandTransport

log = logging.getLogger("kvbm.leader")
_NO_RESPONDERS = "503"


class NatsCommands(CommandTransport):
    name = "nats"

    def __init__(self, bus: NatsBus, node: str) -> None:
        self.bus = bus
        self.node = node

    async def send(self, worker: WorkerRecord, request: "pb.CommandRequest", timeout: float,
                   accept: AckCheck) -> CommandAck:
        nc: Any = self.bus.nc
        if nc is None or not self.bus.is_connected:
            return CommandAck(False, False, "NATS is not connected")
        import nats.errors

        subject = commands_subject(self.node, worker.worker_id)
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            try:
                await nc.publish(subject, request.SerializeToString(), reply=inbox)
                return await self._first_authentic(sub, worker, timeout, accept)
            finally:
                await sub.unsubscribe()
        except nats.errors.Error as exc:
            return CommandAck(False, False, f"{type(exc).__name__}: {exc}")

    async def _first_authentic(self, sub: Any, worker: WorkerRecord, timeout: float,
                               accept: AckCheck) -> CommandAck:
        import nats.errors

        end = time.monotonic() + timeout
        forged = 0
        while True:
            try:
                msg = await sub.next_msg(timeout=max(0.001, end - time.monotonic()))
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                return CommandAck(False, False, f"no acknowledgement signed by worker {worker.worker_id} "
                                                f"within {timeout:g}s ({forged} forged)", forged)
            if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
                # Nobody subscribed: the worker never received it, so nothing can be copying.
                return CommandAck(True, False, f"no worker {worker.worker_id} subscribed on NATS", forged)
            resp = pb.CommandResponse()
            try:
                resp.ParseFromString(msg.data)
            except Exception:  # not even a CommandResponse
                resp = pb.CommandResponse()
            if accept(resp):
                return CommandAck(True, resp.ok, resp.error, forged)
            forged += 1
            log.error("command to worker %s: a reply over NATS not signed by the worker; ignored",
                      worker.worker_id)
