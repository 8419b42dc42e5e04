"""The worker's link to its node's leader: the attach stream (re-attached after a leader
restart), the layout, pool plans and ``PoolsReady`` (with the G3 shard index the leader
restores from, ``DYN_KVBM_DISK_PERSIST``), and each job's ``StartTransfer`` and
``CompleteTransfer``.

The stream also carries the stages clients asked the leader for with their lookups
(``LeaderEvent.stage``), handed to the service, which runs them beside it.

Runs in the worker daemon, on its event loop. Owns the channel to the leader and what the
current attachment implies: the leader's id, the plan key derived from it (the node key and
``Welcome.leader_id``; no key travels) and the leader's grace. While not attached,
``plan_key`` is None, so every plan is refused (UNAVAILABLE).

Lifecycle: ``start(peer)`` after the worker's gRPC server serves; ``close()`` idempotent.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Awaitable, Callable, Protocol

import grpc

from kvbm_client.channels import open_aio_channel
from kvbm_client.config import KvbmConfig
from kvbm_client.contract import pb, rpc
from kvbm_client.ids import WorkerId
from kvbm_client.security import NodeKey

from .allocation import PoolAllocator
from .errors import JobFailed
from .jobs import JobKey
from .leader_gate import JobReport

log = logging.getLogger("kvbm.worker")
RPC_TIMEOUT = 10.0


class LinkPeer(Protocol):
    """What the link needs of the worker service (:class:`kvbm_worker.service.WorkerService`)."""

    pools: PoolAllocator  # read for the G3 shard index to report

    def layout(self) -> "pb.KvLayout | None": ...

    async def apply_pool_plan(self, plan: "pb.PoolPlan") -> tuple[bool, str] | None:
        """Allocate for ``plan``: (ok, error) for ``PoolsReady``, None without a layout yet."""

    def stage(self, request: "pb.TransferRequest") -> None:
        """Run a stage the leader sent (in the background: the stream is not held)."""


class LeaderLink:
    """See the module docstring.

    Args:
        find_leader: with etcd discovery, returns the leader's current address (None: keep).
    """

    def __init__(self, config: KvbmConfig, worker_id: WorkerId, rank: int, address: str, node_key: NodeKey,
                 leader_address: str, cuda: bool,
                 find_leader: Callable[[], Awaitable[str | None]] | None = None) -> None:
        self.config, self.worker_id, self.rank, self.address = config, worker_id, rank, address
        self.node_key, self.leader_address, self.cuda = node_key, leader_address, cuda
        self._find_leader = find_leader
        self.leader_id = ""
        self.plan_key: bytes | None = None
        self.grace = config.job_timeout_secs
        self._attached = asyncio.Event()
        self._channel: grpc.aio.Channel | None = None
        self._leader: rpc.LeaderStub | None = None
        self._peer: LinkPeer | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def _open(self, address: str) -> None:
        self._channel = open_aio_channel(address, self.config, daemon_token=self.node_key.daemon_token)
        self._leader = rpc.LeaderStub(self._channel)

    @property
    def leader(self) -> rpc.LeaderStub:
        if self._leader is None:
            raise RuntimeError("LeaderLink.start() has not been called")
        return self._leader

    async def start(self, peer: LinkPeer) -> None:
        if self._task is not None:
            raise RuntimeError("LeaderLink.start() called twice")
        self._peer = peer
        self._open(self.leader_address)
        self._task = asyncio.ensure_future(self._attach_loop())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._channel is not None:
            await self._channel.close()

    # ------------------------------------------------------------------ attach
    async def _attach_loop(self) -> None:
        backoff = 0.1
        while not self._closed:
            await self._follow_leader()
            try:
                stream = self.leader.Attach(pb.AttachRequest(
                    worker_id=self.worker_id, rank=self.rank, endpoint=self.address, pid=os.getpid(), cuda=self.cuda))
                async for event in stream:
                    backoff = 0.1
                    await self._on_event(event)
                    if event.HasField("shutdown"):
                        log.info("leader shut down: %s", event.shutdown.reason)
                        break
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND):
                    log.error("leader refused attach: %s", exc.details())
                else:
                    log.debug("attach stream ended: %s", exc.code().name)
            self._attached.clear()
            self.plan_key = None
            if self._closed:
                return
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    async def _follow_leader(self) -> None:
        """With etcd discovery, (re)read the leader's address before each attach."""
        if self._find_leader is None:
            return
        try:
            address = await self._find_leader()
        except TimeoutError as exc:
            log.error("%s", exc)
            return
        if address and address != self.leader_address:
            log.info("leader found in etcd at %s", address)
            old, self.leader_address = self._channel, address
            self._open(address)
            if old is not None:
                await old.close()

    async def _on_event(self, event: "pb.LeaderEvent") -> None:
        which = event.WhichOneof("event")
        if which == "welcome":
            self.leader_id = event.welcome.leader_id
            self.plan_key = self.node_key.plan_key(event.welcome.leader_id)
            if event.welcome.job_timeout_s > 0:
                self.grace = event.welcome.job_timeout_s
            self._attached.set()
            if self._peer is not None:
                self._peer.pools.unannounce()  # our Status is not "ready" until this leader accepts our pools
            log.info("attached to leader %s", event.welcome.leader_id)
            await self.layout_changed()
        elif which == "pools":
            await self._apply(event.pools)
        elif which == "stage":
            assert self._peer is not None
            self._peer.stage(event.stage)

    async def _apply(self, plan: "pb.PoolPlan") -> None:
        assert self._peer is not None
        result = await self._peer.apply_pool_plan(plan)
        if result is None:
            return
        ok, error = result
        index = self._peer.pools.disk_index if ok else ""
        try:
            await self.leader.PoolsReady(pb.PoolsReadyRequest(worker_id=self.worker_id, epoch=plan.epoch, ok=ok,
                                                              error=error, disk_index=index), timeout=RPC_TIMEOUT)
        except grpc.RpcError as exc:
            log.warning("could not report pools ready: %s", exc.details())
            return
        if ok:
            self._peer.pools.announce(plan.epoch)  # our Status says "ready" from now on

    async def layout_changed(self) -> None:
        """Send the engine's layout (a region appeared, or a leader welcomed us)."""
        layout = self._peer.layout() if self._peer is not None else None
        if layout is None or not self._attached.is_set():
            return
        try:
            await self.leader.SetLayout(pb.SetLayoutRequest(worker_id=self.worker_id, layout=layout),
                                        timeout=RPC_TIMEOUT)
        except grpc.RpcError as exc:
            log.warning("could not send the layout to the leader: %s", exc.details())

    # ------------------------------------------------------------------ jobs
    async def start_job(self, job: JobKey) -> float:
        """The leader's go before a new job's first byte moves: the job's deadline. Raises
        :class:`JobFailed` (FAILED_PRECONDITION / DEADLINE_EXCEEDED as the leader said, else
        UNAVAILABLE) when it is not live.

        NOTE: a job of a leader that is gone is refused here, never asked for: job ids and
        epochs restart with a leader, so the new leader could say yes to its own job of the
        same id and the old plan would write into slots the new leader gave to other blocks."""
        job_id = job.job_id
        if job.leader_id != self.leader_id:
            raise JobFailed(grpc.StatusCode.FAILED_PRECONDITION, f"job {job_id} is of leader {job.leader_id}, "
                            f"attached to {self.leader_id or 'none'}: move nothing")
        try:
            resp = await self.leader.StartTransfer(pb.StartTransferRequest(
                worker_id=self.worker_id, job_id=job_id, epoch=job.epoch), timeout=RPC_TIMEOUT)
        except grpc.RpcError as exc:
            code = exc.code() if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                                grpc.StatusCode.DEADLINE_EXCEEDED) else grpc.StatusCode.UNAVAILABLE
            raise JobFailed(code, f"job {job_id}: the leader did not let it start: {exc.details()}") from None
        return float(resp.deadline) if resp.deadline > 0 else float("inf")

    async def report(self, report: JobReport) -> bool:
        try:
            resp = await self.leader.CompleteTransfer(pb.CompleteTransferRequest(
                worker_id=self.worker_id, job_id=report.job_id, ok=report.ok, error=report.error, bytes=report.moved,
                seconds=report.seconds, bad_disk_slots=report.bad_disk_slots, bad_host_slots=report.bad_host_slots),
                timeout=RPC_TIMEOUT)
            return bool(resp.accepted)
        except grpc.RpcError as exc:
            log.warning("could not report job %d to the leader: %s", report.job_id, exc.details())
            return False
