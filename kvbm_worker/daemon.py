"""The worker daemon's shell: its gRPC server, the attach stream to the leader (re-attached
after a leader restart), pool allocation on the leader's plans, signals.

Lifecycle (ordered, idempotent): ``start()`` binds the server then attaches; ``close()``
detaches, stops the server, drains copies, and frees pools and disk files in reverse.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys
import time

import grpc

from kvbm_client.config import KvbmConfig, add_config_arguments, config_from_args
from kvbm_client.channels import open_aio_channel
from kvbm_client.contract import pb, rpc
from kvbm_client.endpoints import remove_unix_socket
from kvbm_client.errors import KvbmConfigError
from kvbm_client.security import NodeKey, wait_node_key
from kvbm_client.serving import make_server, start_server
from kvbm_client.logs import log_loop_stalls, setup_logging

from .cluster import WorkerCluster
from .handlers.disk import open_disk_io
from .pools import DiskPool, HostPool, SlotGeometry
from .service import Pools, WorkerService
from .transfers import TransferEngine

log = logging.getLogger("kvbm.worker")


class WorkerDaemon:
    """One per GPU (or ``--cpu``). Owns the :class:`WorkerService`, its pools and files."""

    def __init__(self, config: KvbmConfig, worker_id: str, rank: int, address: str | None = None,
                 leader_address: str | None = None, prefer_nixl: bool = True, gpu: int | None = None,
                 cuda_copy: str = "auto") -> None:
        self.config = config
        self.worker_id = worker_id
        self.rank = rank
        self.address = address or config.worker_address(worker_id)
        self.leader_address = leader_address or config.resolved_leader_address
        self.prefer_nixl = prefer_nixl
        self.gpu, self.cuda_copy = gpu, cuda_copy  # GPU data path (handlers/cuda.py) when gpu is set
        self.service = WorkerService(worker_id, rank, self._report, self._start_job)
        self.service._on_layout = self._send_layout
        self.node_key: NodeKey | None = None  # read at start (the leader creates it)
        # etcd / NATS when configured; the leader is found through etcd unless given explicitly
        self.cluster = WorkerCluster(config, self.service, self.address,
                                     discover_leader=leader_address is None and config.leader_address is None)
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._leader: rpc.LeaderStub | None = None
        self._attach_task: asyncio.Task | None = None
        self._attached = asyncio.Event()
        self._plan_lock = asyncio.Lock()
        self.leader_shutdown = asyncio.Event()
        self._started = self._closed = False
        self._stall_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._started:
            raise RuntimeError("WorkerDaemon.start() called twice")
        self._started = True
        self.node_key = await wait_node_key(self.config.resolved_node_key_file,
                                            self.config.leader_worker_init_timeout_secs)
        self.service.node_key = self.node_key
        if self.gpu is not None:  # CUDA context before serving, off the loop; lazy import (CPU CI)
            from .handlers.cuda import init_device, open_region
            name = await asyncio.get_running_loop().run_in_executor(None, init_device, self.gpu)
            self.service.region_factory = functools.partial(open_region, device=self.gpu)
            log.info("GPU data path on cuda:%d (%s), copy mechanism %s", self.gpu, name, self.cuda_copy)
        self._server = make_server(self.config, self.address, self.node_key)
        rpc.add_WorkerServicer_to_server(self.service, self._server)
        await start_server(self._server, self.address, self.config)
        await self.cluster.start()
        self._channel = open_aio_channel(self.leader_address, self.config, daemon_token=self.node_key.daemon_token)
        self._leader = rpc.LeaderStub(self._channel)
        self._attach_task = asyncio.ensure_future(self._attach_loop())
        if log.isEnabledFor(logging.DEBUG):  # DYN_LOG=debug: say when the loop could not answer
            self._stall_task = asyncio.ensure_future(log_loop_stalls(log))
        log.info("worker %s (rank %d) listening on %s; leader %s", self.worker_id, self.rank, self.address,
                 self.leader_address)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.service.closing = True
        if self._stall_task is not None:
            self._stall_task.cancel()
        if self._attach_task is not None:
            self._attach_task.cancel()
            try:
                await self._attach_task
            except (asyncio.CancelledError, Exception):
                pass
        await self.cluster.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        await self.service.drain()
        self.service.shutdown_lanes()
        if self.service.pools is not None:
            self.service.pools.close()
            self.service.pools = None
        if self.service.region is not None:
            self.service.region.close()
            self.service.region = None
        if self._channel is not None:
            await self._channel.close()
        remove_unix_socket(self.address)
        log.info("worker %s stopped", self.worker_id)

    # ------------------------------------------------------------------ leader link
    async def _attach_loop(self) -> None:
        backoff = 0.1
        while not self.service.closing:
            await self._follow_leader()
            try:
                stream = self._leader.Attach(pb.AttachRequest(
                    worker_id=self.worker_id, rank=self.rank, endpoint=self.address, pid=os.getpid(),
                    cuda=self.gpu is not None))
                async for event in stream:
                    backoff = 0.1
                    await self._on_event(event)
                    if event.HasField("shutdown"):
                        log.info("leader shut down: %s", event.shutdown.reason)
                        self.leader_shutdown.set()
                        break
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    log.error("leader refused attach: %s", exc.details())
                elif exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.error("leader refused attach: %s", exc.details())
                else:
                    log.debug("attach stream ended: %s", exc.code().name)
            self._attached.clear()
            self.service.secret = None
            if self.service.closing:
                return
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    async def _follow_leader(self) -> None:
        """With etcd discovery, (re)read the leader's address before each attach."""
        try:
            address = await self.cluster.leader_address(self.config.leader_worker_init_timeout_secs)
        except TimeoutError as exc:
            log.error("%s", exc)
            return
        if address and address != self.leader_address:
            log.info("leader of node %s found in etcd at %s", self.cluster.node, address)
            old, self.leader_address = self._channel, address
            assert self.node_key is not None
            self._channel = open_aio_channel(address, self.config, daemon_token=self.node_key.daemon_token)
            self._leader = rpc.LeaderStub(self._channel)
            if old is not None:
                await old.close()

    async def _on_event(self, event) -> None:
        which = event.WhichOneof("event")
        if which == "welcome":
            assert self.node_key is not None
            self.service.secret = self.node_key.plan_key(event.welcome.leader_id)
            self.service.leader_id = event.welcome.leader_id
            self._attached.set()
            log.info("attached to leader %s", event.welcome.leader_id)
            await self._send_layout()
        elif which == "pools":
            await self._apply_plan(event.pools)

    async def _send_layout(self) -> None:
        layout = self.service.layout()
        if layout is None or not self._attached.is_set():
            return
        try:
            await self._leader.SetLayout(pb.SetLayoutRequest(worker_id=self.worker_id, layout=layout), timeout=10)
        except grpc.RpcError as exc:
            log.warning("could not send the layout to the leader: %s", exc.details())

    async def _start_job(self, job_id: int, epoch: int) -> None:
        """Ask the leader whether job ``job_id`` is still live before its first byte moves;
        raises ``grpc.RpcError`` (with the leader's status) when it is not."""
        await self._leader.StartTransfer(pb.StartTransferRequest(worker_id=self.worker_id, job_id=job_id,
                                                                 epoch=epoch), timeout=10)

    async def _report(self, job_id: int, ok: bool, error: str, moved: int, seconds: float) -> bool:
        try:
            resp = await self._leader.CompleteTransfer(pb.CompleteTransferRequest(
                worker_id=self.worker_id, job_id=job_id, ok=ok, error=error, bytes=moved, seconds=seconds),
                timeout=10)
            return resp.accepted
        except grpc.RpcError as exc:
            log.warning("could not report job %d to the leader: %s", job_id, exc.details())
            return False

    # ------------------------------------------------------------------ pools
    async def _apply_plan(self, plan) -> None:
        async with self._plan_lock:
            layout = self.service.layout()
            if layout is None:
                return
            block_bytes = layout.num_layers * layout.page_bytes
            host_geo = SlotGeometry.of(block_bytes, plan.host_slots)
            disk_geo = SlotGeometry.of(block_bytes, plan.disk_slots)
            old = self.service.pools
            ok, error = True, ""
            if old is not None and _same(old.host, host_geo) and _same(old.disk, disk_geo):
                old.epoch = plan.epoch  # same geometry: keep the memory, contents are now void
                log.info("pools kept for epoch %d", plan.epoch)
            else:
                self.service.pools = None
                await self.service.drain()
                if old is not None:
                    old.close()
                try:
                    self.service.pools = await asyncio.get_running_loop().run_in_executor(
                        None, self._allocate, plan.epoch, host_geo, disk_geo)
                    await self.service.warm_lanes()
                except Exception as exc:
                    ok, error = False, f"{type(exc).__name__}: {exc}"
                    log.error("pool allocation failed: %s", error)
            try:
                await self._leader.PoolsReady(pb.PoolsReadyRequest(
                    worker_id=self.worker_id, epoch=plan.epoch, ok=ok, error=error), timeout=10)
            except grpc.RpcError as exc:
                log.warning("could not report pools ready: %s", exc.details())

    def _allocate(self, epoch: int, host_geo: SlotGeometry, disk_geo: SlotGeometry) -> Pools:
        cfg = self.config
        host = disk = None
        self._deadline = time.monotonic() + cfg.leader_worker_init_timeout_secs
        self._logged_step = -1
        try:
            if host_geo.num_slots:
                log.info("allocating G2: %d slots x %d bytes = %.2f GB", host_geo.num_slots, host_geo.slot_bytes,
                         host_geo.total_bytes / 1e9)
                host = HostPool(host_geo)
                host.commit(self._progress if self.gpu is None else lambda f: self._progress(f / 2))
            disk_io = None
            if disk_geo.num_slots:
                disk = DiskPool(disk_geo, cfg.disk_cache_dir, o_direct=not cfg.disk_disable_o_direct,
                                zerofill_fallback=cfg.disk_zerofill_fallback)
                disk_io = open_disk_io(disk.fd, disk_geo.total_bytes, f"kvbm-worker-{self.worker_id}-{os.getpid()}",
                                       prefer_nixl=self.prefer_nixl)
                log.info("G3: %s, %d slots (%.2f GB), I/O via %s", disk.path, disk_geo.num_slots,
                         disk_geo.total_bytes / 1e9, disk_io.name)
            if self.gpu is not None:
                from .handlers.cuda import CudaTransferEngine
                engine = CudaTransferEngine(host, disk, disk_io, self.gpu, self.cuda_copy,
                                            lambda f: self._progress(0.5 + f / 2), self._deadline)
            else:
                engine = TransferEngine(host, disk, disk_io)
            return Pools(epoch, host, disk, engine, disk_io.name if disk_io else "")
        except BaseException:
            for pool in (disk, host):
                if pool is not None:
                    pool.close()
            raise

    def _progress(self, fraction: float) -> None:
        self.service.alloc_progress = fraction
        step = int(fraction * 10)
        if step != getattr(self, "_logged_step", step):
            self._logged_step = step
            log.info("G2 allocation %.0f%%%s", fraction * 100,
                     " (pinning for CUDA)" if self.gpu is not None and fraction > 0.5 else "")
        if time.monotonic() > getattr(self, "_deadline", float("inf")) and fraction < 1.0:
            raise TimeoutError(f"G2 allocation at {fraction * 100:.0f}% after the init timeout "
                               f"({self.config.leader_worker_init_timeout_secs:g}s, "
                               "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS)")


def _same(pool, geometry: SlotGeometry) -> bool:
    if pool is None:
        return geometry.num_slots == 0
    return pool.geometry == geometry


async def run(daemon: WorkerDaemon) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await daemon.start()
        await stop.wait()
    finally:
        await daemon.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbm-worker",
        description="kvbm worker daemon (one per GPU): owns the G2 host pool and G3 disk file of its GPU, "
                    "maps the engine's KV memory and moves blocks on the leader's signed plans.")
    parser.add_argument("--worker-id", default="0", help="this worker's id, as the leader expects it [default 0]")
    parser.add_argument("--rank", type=int, default=None, help="engine rank (TP rank) [default: the worker id]")
    parser.add_argument("--listen", default=None,
                        help="gRPC address: unix:/path or host:port [default <socket dir>/worker-ID.sock]")
    parser.add_argument("--insecure", action="store_true",
                        help="allow --listen on TCP without TLS and client authentication (test setups only; "
                             "logged as a warning) [env DYN_KVBM_INSECURE_TCP]")
    parser.add_argument("--leader", default=None, help="leader address [default DYN_KVBM_LEADER_ADDRESS or "
                                                       "<socket dir>/leader.sock]")
    parser.add_argument("--cpu", action="store_true",
                        help="CPU engine: the KV cache is shared memory (the default without --gpu)")
    parser.add_argument("--gpu", type=int, default=None, metavar="DEVICE",
                        help="GPU engine on CUDA device DEVICE: open its KV cache through CUDA IPC, pin G2, "
                             "copy on CUDA streams (needs torch with CUDA and cuda-python)")
    parser.add_argument("--cuda-copy", default="auto", choices=("auto", "runs", "batch", "gather"),
                        help="G1<->G2 copy mechanism with --gpu [default auto: DMA per contiguous run "
                             "when runs are long, GPU gather + DMA when pages are small]")
    parser.add_argument("--no-nixl", action="store_true", help="use preadv/pwritev for disk I/O instead of NIXL")
    add_config_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(f"kvbm-worker-{args.worker_id}")
    try:
        config = config_from_args(args)
    except KvbmConfigError as exc:
        print(f"kvbm-worker: {exc}", file=sys.stderr)
        return 2
    rank = args.rank if args.rank is not None else (int(args.worker_id) if args.worker_id.isdigit() else 0)
    daemon = WorkerDaemon(config, args.worker_id, rank, args.listen, args.leader, prefer_nixl=not args.no_nixl,
                          gpu=args.gpu, cuda_copy=args.cuda_copy)
    import uvloop
    return uvloop.run(run(daemon))


if __name__ == "__main__":
    sys.exit(main())
