"""Worker side of the NATS command transport: ``kvbm.v1.commands.<node>.<worker>``.

Runs in the worker daemon, on its event loop. Each request is a serialized
``CommandRequest``; it goes through exactly the checks and the job path of the gRPC
``Worker.Command`` (:meth:`kvbm_worker.runner.JobRunner.acknowledge`), and the reply, a
serialized ``CommandResponse`` signed with the node's ack key, is the acknowledgement. A
rejected command answers ``ok=False`` with the status and the reason (signed when the plan's
signature verified, so its job id is known); nothing has moved then.
"""
from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from kvbm_client.bus import NatsBus, commands_subject
from kvbm_client.contract import pb

log = logging.getLogger("kvbm.worker")

Acknowledge = Callable[["pb.CommandRequest"], Awaitable["pb.CommandResponse"]]


class NatsCommandServer:
    """Subscribes the worker to its command subject and answers each command.

    Args:
        acknowledge: the job runner's ``acknowledge`` (never raises for a rejected command).
    """

    def __init__(self, bus: NatsBus, node: str, worker_id: str, acknowledge: Acknowledge) -> None:
        self.bus = bus
        self.subject = commands_subject(node, worker_id)
        self.worker_id = worker_id
        self._acknowledge = acknowledge
        self.handled = 0

    async def start(self) -> None:
        await self.bus.subscribe(self.subject, self._on_message)

    async def _on_message(self, msg: Any) -> None:
        request = pb.CommandRequest()
        try:
            request.ParseFromString(msg.data)
            resp = await self._acknowledge(request)
        except Exception as exc:  # a malformed message must not kill the subscription
            log.exception("command on %s", self.subject)
            resp = pb.CommandResponse(ok=False, error=f"{type(exc).__name__}: {exc}", worker_id=self.worker_id)
        self.handled += 1
        log.debug("command over NATS: %s", "ok" if resp.ok else resp.error)
        if msg.reply:
            try:
                await msg.respond(resp.SerializeToString())
            except Exception as exc:  # the leader will let the job expire
                log.warning("could not acknowledge a command: %s", exc)
