"""The leader's cluster plane: the NATS bus (commands to workers, KV events for routers) and
the etcd registration.

Runs in the leader daemon, on its event loop; only what is configured exists (nothing in the
embedded single-node default: commands go over gRPC, events nowhere). The transports are
built at construction, so the daemon hands them to the service before anything serves.

Lifecycle: ``start()`` before the gRPC server serves (NATS connects in the background, the
event publisher starts); ``register(describe)`` after it serves (etcd: a wrong
``ETCD_ENDPOINTS`` fails the start); ``close()`` in reverse order, idempotent.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from kvbm_client.bus import NatsBus, events_subject, nats_auth
from kvbm_client.config import KvbmConfig
from kvbm_client.discovery import EtcdRegistration, leader_key
from kvbm_client.security import NodeKey

from .commands import CommandTransport
from .commands import create as create_commands
from .events import KvEventPublisher, NullEvents
from .metrics import LeaderMetrics

log = logging.getLogger("kvbm.leader")
REFRESH_SECONDS = 0.5  # how often the leader's etcd record is brought up to date


class LeaderCluster:
    """Owns the command transport, the KV event sink, the NATS connection and the etcd lease."""

    def __init__(self, config: KvbmConfig, node_key: NodeKey, leader_id: str, metrics: LeaderMetrics) -> None:
        self.config = config
        self.node = config.resolved_node_name
        self.bus: NatsBus | None = None
        self.events: NullEvents = NullEvents()
        self._publisher: KvEventPublisher | None = None
        if config.nats_server:
            self.bus = NatsBus(config.nats_server, f"kvbm-leader-{self.node}", nats_auth(config))
            self.commands: CommandTransport = create_commands("nats", bus=self.bus, node=self.node)
            self._publisher = KvEventPublisher(self.bus, events_subject(self.node), self.node, leader_id,
                                               config.event_buffer, metrics)
            self.events = self._publisher
        else:
            self.commands = create_commands("grpc", config=config, node_key=node_key)
        self.etcd: EtcdRegistration | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self) -> None:
        """Connect NATS (in the background) and start publishing events."""
        if self.bus is not None and self._publisher is not None:
            await self.bus.start()
            self._publisher.start()
            log.info("NATS %s: commands on kvbm.v1.commands.%s.<worker>, KV events on %s", self.config.nats_server,
                     self.node, events_subject(self.node))

    async def register(self, describe: Callable[[], dict[str, Any]]) -> None:
        """Register in etcd (raises when etcd is unreachable) and keep ``describe()`` current."""
        cfg = self.config
        if not cfg.etcd_endpoints:
            return
        etcd = self.etcd = EtcdRegistration(cfg.etcd_endpoints, cfg.etcd_lease_ttl_secs)
        await etcd.start()
        await etcd.put(leader_key(self.node), describe())
        self._refresher = asyncio.ensure_future(self._refresh(etcd, describe))
        log.info("registered in etcd %s as %s (lease TTL %ds)", cfg.etcd_endpoints, leader_key(self.node),
                 cfg.etcd_lease_ttl_secs)

    async def _refresh(self, etcd: EtcdRegistration, describe: Callable[[], dict[str, Any]]) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await etcd.put(leader_key(self.node), describe())  # no-op when unchanged
            except Exception:
                log.exception("etcd record refresh")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
        if self.etcd is not None:
            await self.etcd.close()
        await self.commands.close()
        await self.events.close()
        if self.bus is not None:
            await self.bus.close()
