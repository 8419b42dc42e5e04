"""Worker streams: the leader's side of each worker's ``Attach`` stream.

Runs in the leader, on its event loop. Owns one event queue per attached worker; the
``Attach`` handler drains it (``Welcome`` first, then pool sizes and the stages clients asked
for with their lookups, then ``Shutdown``). Events
are put without waiting (a slow worker never holds the leader).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from kvbm_client.contract import pb
from kvbm_client.ids import WorkerId

from .membership import PoolSizes


class WorkerStreams:
    """See the module docstring."""

    def __init__(self) -> None:
        self._queues: dict[WorkerId, asyncio.Queue[pb.LeaderEvent | None]] = {}

    def __contains__(self, worker_id: WorkerId) -> bool:
        return worker_id in self._queues

    async def serve(self, worker_id: WorkerId, welcome: "pb.Welcome") -> AsyncIterator["pb.LeaderEvent"]:
        """The events of ``worker_id``'s stream until it is closed (the caller's ``finally``
        runs when the worker goes away)."""
        queue: asyncio.Queue[pb.LeaderEvent | None] = asyncio.Queue()
        self._queues[worker_id] = queue
        try:
            yield pb.LeaderEvent(welcome=welcome)
            while True:
                event = await queue.get()
                if event is None:
                    return
                yield event
        finally:
            if self._queues.get(worker_id) is queue:
                del self._queues[worker_id]

    def send_pools(self, sizes: PoolSizes, worker_id: WorkerId | None = None) -> None:
        """Tell one worker (or every attached worker) the pool sizes to allocate."""
        event = pb.LeaderEvent(pools=pb.PoolPlan(epoch=sizes.epoch, host_slots=sizes.host_slots,
                                                  disk_slots=sizes.disk_slots))
        for target in [worker_id] if worker_id is not None else list(self._queues):
            self.send(target, event)

    def send(self, worker_id: WorkerId, event: "pb.LeaderEvent") -> bool:
        """Queue ``event`` on ``worker_id``'s stream; False when it has none (not attached)."""
        queue = self._queues.get(worker_id)
        if queue is None:
            return False
        queue.put_nowait(event)
        return True

    def shutdown(self, reason: str) -> None:
        """Tell every worker the leader is going, and end the streams."""
        for queue in list(self._queues.values()):
            queue.put_nowait(pb.LeaderEvent(shutdown=pb.Shutdown(reason=reason)))
            queue.put_nowait(None)
