"""Commands over gRPC ``Worker.Command`` (the default, without NATS).

Runs in the leader; one channel per worker endpoint (the endpoint the worker gave when it
attached with the daemon token), dropped when the worker detaches.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import grpc

from kvbm_client.channels import open_aio_channel
from kvbm_client.config import KvbmConfig
from kvbm_client.contract import pb, rpc
from kvbm_client.ids import WorkerId
from kvbm_client.security import NodeKey
from kvbm_client.tasks import TaskSet

from ..membership import WorkerRecord
from .base import AckCheck, CommandAck, CommandTransport

log = logging.getLogger("kvbm.leader")

# The call ended without the worker's word on the job: the copy may still run.
_UNKNOWN = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.UNKNOWN}


class GrpcCommands(CommandTransport):
    name = "grpc"

    def __init__(self, config: KvbmConfig, node_key: NodeKey) -> None:
        self.config = config
        self.token = node_key.daemon_token
        self._stubs: dict[WorkerId, tuple[Any, Any]] = {}  # worker -> (aio channel, WorkerStub)
        self._closing = TaskSet(log, "channel close")  # channels of forgotten workers (held until closed)

    async def send(self, worker: WorkerRecord, request: "pb.CommandRequest", timeout: float,
                   accept: AckCheck) -> CommandAck:
        if worker.worker_id not in self._stubs:
            channel = open_aio_channel(worker.endpoint, self.config, daemon_token=self.token)
            make_stub: Callable[[Any], Any] = rpc.WorkerStub  # generated, untyped
            self._stubs[worker.worker_id] = (channel, make_stub(channel))
        stub = self._stubs[worker.worker_id][1]
        try:
            resp: pb.CommandResponse = await stub.Command(request, timeout=timeout)
        except grpc.RpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
            return CommandAck(exc.code() not in _UNKNOWN, False, error)
        if not accept(resp):
            return CommandAck(False, False, "acknowledgement not signed by the worker", forged=1)
        return CommandAck(True, resp.ok, resp.error)

    def forget(self, worker_id: WorkerId) -> None:
        entry = self._stubs.pop(worker_id, None)
        if entry is not None:
            self._closing.spawn(entry[0].close(), f"worker {worker_id}")

    async def close(self) -> None:
        for channel, _ in list(self._stubs.values()):
            await channel.close()
        self._stubs.clear()
