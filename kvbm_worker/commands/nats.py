"""Worker side of the NATS command transport: ``kvbm.v1.commands.<node>.<worker>``.

Runs in the worker daemon, on its event loop. Each request is a serialized
``CommandRequest``; it goes through exactly the checks of the gRPC ``Worker.Command``
(signature, pool epoch, deadline, slot ranges), and the reply, a serialized
``CommandResponse``, is the acknowledgement. A rejected command answers ``ok=False`` with
the status and the reason; nothing has moved then.
"""
from __future__ import annotations

import logging

from kvbm_client.bus import NatsBus, commands_subject
from kvbm_client.contract import pb

from ..service import WorkerService

log = logging.getLogger("kvbm.worker")


class CommandRejected(Exception):
    def __init__(self, code, details: str) -> None:
        super().__init__(f"{code.name}: {details}")


class _ReplyContext:
    """Stands in for a gRPC servicer context: ``abort`` raises instead of ending an RPC."""

    async def abort(self, code, details: str = ""):
        raise CommandRejected(code, details)


class NatsCommandServer:
    """Subscribes the worker to its command subject and answers each command."""

    def __init__(self, bus: NatsBus, node: str, service: WorkerService) -> None:
        self.bus = bus
        self.subject = commands_subject(node, service.worker_id)
        self.service = service
        self.handled = 0

    async def start(self) -> None:
        await self.bus.subscribe(self.subject, self._on_message)

    async def _on_message(self, msg) -> None:
        request = pb.CommandRequest()
        try:
            request.ParseFromString(msg.data)
            resp = await self.service.Command(request, _ReplyContext())
        except CommandRejected as exc:
            resp = pb.CommandResponse(ok=False, error=str(exc))
        except Exception as exc:  # a malformed message must not kill the subscription
            log.exception("command on %s", self.subject)
            resp = pb.CommandResponse(ok=False, error=f"{type(exc).__name__}: {exc}")
        self.handled += 1
        log.debug("command over NATS: %s", "ok" if resp.ok else resp.error)
        if msg.reply:
            try:
                await msg.respond(resp.SerializeToString())
            except Exception as exc:  # the leader will let the job expire
                log.warning("could not acknowledge a command: %s", exc)
