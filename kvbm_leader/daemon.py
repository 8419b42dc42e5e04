"""The leader daemon's shell: sockets, metrics, the worker barrier, the tick loop, signals.

Lifecycle (ordered, idempotent): ``__init__`` builds the cluster plane's transports and the
service with them; ``start()`` starts NATS, binds the gRPC server, serves metrics, registers
in etcd and starts the tick; ``close()`` stops them in reverse order. ``run()`` adds the init
barrier and waits for SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import Any, Callable

from kvbm_client.config import KvbmConfig, add_config_arguments, config_from_args
from kvbm_client.contract import rpc
from kvbm_client.endpoints import ensure_socket_dir, remove_unix_socket
from kvbm_client.errors import KvbmConfigError
from kvbm_client.heap import freeze_startup_heap, log_slow_collections
from kvbm_client.security import create_node_key
from kvbm_client.serving import make_server, start_server
from kvbm_client.discovery import describe_self
from kvbm_client.ids import WorkerId
from kvbm_client.logs import log_loop_stalls, setup_logging

from .cluster import LeaderCluster
from .metrics import LeaderMetrics
from .presence import PresenceFilter, file_prefix, filter_path, remove_stale_files
from .service import LeaderService, new_leader_id
from .servicer import LeaderServicer

log = logging.getLogger("kvbm.leader")
TICK_SECONDS = 0.1


class LeaderDaemon:
    """One per node. Owns the :class:`LeaderService` and its server."""

    def __init__(self, config: KvbmConfig, workers: list[WorkerId], address: str | None = None) -> None:
        self.config = config
        self.address = address or config.resolved_leader_address
        if config.node_key_file is None:  # the default key lives in the (checked) socket dir
            ensure_socket_dir(config.resolved_socket_dir)
        self.node_key = create_node_key(config.resolved_node_key_file)
        leader_id = new_leader_id()
        self.metrics = LeaderMetrics()
        # NATS and etcd when configured; its transports go into the service before anything serves
        self.cluster = LeaderCluster(config, self.node_key, leader_id, self.metrics)
        self.presence = self._presence(leader_id)
        self.service = LeaderService(config, workers, self.node_key, self.cluster.commands, self.cluster.events,
                                     self.metrics, leader_id, self.presence)
        self._server: Any = None  # grpc.aio.Server
        self._ticker: asyncio.Task[None] | None = None
        self._stall_watch: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False

    def _presence(self, leader_id: str) -> PresenceFilter | None:
        """The presence filter's file (in a 0700 directory: only the leader's user can map it),
        replacing any an earlier leader of this socket dir left; None when disabled or the
        directory cannot hold it."""
        slots = self.config.presence_filter_slots
        if not slots:
            return None
        socket_dir = self.config.resolved_socket_dir
        directory, path = filter_path(socket_dir, leader_id)
        try:
            ensure_socket_dir(directory)
            remove_stale_files(directory, file_prefix(socket_dir))
            presence = PresenceFilter(path, slots, leader_id)
        except (OSError, KvbmConfigError) as exc:
            log.warning("no presence filter (%s): every lookup is a round trip", exc)
            return None
        log.info("presence filter %s (%d slots) for local clients", presence.path, slots)
        return presence

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("LeaderDaemon.start() called twice")
        self._started = True
        await self.cluster.start()
        self._server = make_server(self.config, self.address, self.node_key)
        add_servicer: Callable[[LeaderServicer, Any], None] = rpc.add_LeaderServicer_to_server
        add_servicer(LeaderServicer(self.service), self._server)
        await start_server(self._server, self.address, self.config)
        if self.config.metrics:
            self.metrics.serve(self.config.metrics_port, self.config.metrics_addr)
            log.info("metrics on http://%s:%d/metrics", self.config.metrics_addr, self.config.metrics_port)
        await self.cluster.register(self._describe)
        self._ticker = asyncio.ensure_future(self._tick_loop())
        if log.isEnabledFor(logging.DEBUG):  # DYN_LOG=debug: say when the loop could not answer
            self._stall_watch = asyncio.ensure_future(log_loop_stalls(log))
        log.info("leader %s listening on %s; expecting workers %s", self.service.leader_id, self.address,
                 ", ".join(self.service.membership.expected))

    def _describe(self) -> dict[str, Any]:
        """The leader's etcd record."""
        svc, pools = self.service, self.service.membership.pools
        return describe_self("leader", leader_id=svc.leader_id, node=self.cluster.node, endpoint=self.address,
                             ready=svc.membership.ready,
                             capacity={"G2": pools.host_slots if pools else 0, "G3": pools.disk_slots if pools else 0},
                             workers=sorted(svc.membership.workers), expected=list(svc.membership.expected),
                             nats=bool(self.config.nats_server))

    async def _tick_loop(self) -> None:
        next_decay = time.monotonic() + self.config.disk_filter_decay_secs
        while True:
            await asyncio.sleep(TICK_SECONDS)
            now = time.monotonic()
            try:
                await self.service.tick(now)
                if now >= next_decay:
                    self.service.frequency.decay()
                    next_decay = now + self.config.disk_filter_decay_secs
            except Exception:  # a bug here must not stop expiry for good
                log.exception("leader tick failed")

    async def wait_for_workers(self) -> None:
        """The init barrier: every expected worker attaches within the init timeout."""
        timeout = self.config.leader_worker_init_timeout_secs
        if not await self.service.wait_attached(timeout):
            missing = self.service.membership.missing
            raise TimeoutError(f"workers {', '.join(missing)} did not attach within {timeout:g}s "
                               "(DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS)")
        log.info("all %d workers attached", len(self.service.membership.expected))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in (self._stall_watch, self._ticker):
            if task is not None:
                task.cancel()
        await self.service.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        self.metrics.close()
        await self.cluster.close()
        remove_unix_socket(self.address)
        if self.presence is not None:
            self.presence.close()
        log.info("leader stopped")


async def run(daemon: LeaderDaemon) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        try:
            await daemon.start()
        except KvbmConfigError as exc:  # e.g. TCP without TLS, a socket dir that is not ours
            log.error("%s", exc)
            return 2
        freeze_startup_heap("leader")  # (the registry's blocks are untracked; see kvbm_client.heap)
        if log.isEnabledFor(logging.DEBUG):
            log_slow_collections("leader")
        barrier = asyncio.ensure_future(daemon.wait_for_workers())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({barrier, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if barrier.done() and barrier.exception() is not None:
            log.error("%s", barrier.exception())
            code = 3
        else:
            await stopper
        barrier.cancel()
        stopper.cancel()
    finally:
        await daemon.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbm-leader",
        description="kvbm leader daemon (one per node): owns block metadata, tier placement, eviction "
                    "and the disk offload filter; serves gRPC to connectors and workers.")
    parser.add_argument("--num-workers", type=int, default=1,
                        help="workers expected on this node, with ids 0..N-1 (one per GPU) [default 1]")
    parser.add_argument("--workers", default=None,
                        help="comma-separated worker ids expected instead of 0..N-1")
    parser.add_argument("--listen", default=None,
                        help="gRPC address: unix:/path or host:port (TCP needs TLS and client tokens, see "
                             "DYN_KVBM_TLS_* and DYN_KVBM_CLIENT_TOKEN_FILE) "
                             "[default: DYN_KVBM_LEADER_ADDRESS or <socket dir>/leader.sock]")
    parser.add_argument("--insecure", action="store_true",
                        help="allow --listen on TCP without TLS and client authentication (test setups only; "
                             "logged as a warning) [env DYN_KVBM_INSECURE_TCP]")
    add_config_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("kvbm-leader")
    workers = [WorkerId(w) for w in args.workers.split(",")] if args.workers else \
        [WorkerId(str(i)) for i in range(args.num_workers)]
    try:
        config = config_from_args(args)
        config.require_tier()
        daemon = LeaderDaemon(config, workers, args.listen)
    except KvbmConfigError as exc:
        print(f"kvbm-leader: {exc}", file=sys.stderr)
        return 2
    import uvloop
    return int(uvloop.run(run(daemon)))


if __name__ == "__main__":
    sys.exit(main())
