"""The leader's cluster plane: etcd registration and the NATS bus (commands, KV events).

Runs in the leader daemon, on its event loop; only what is configured starts (nothing in
the embedded single-node default). Lifecycle: ``start()`` after the gRPC server is bound
(etcd first: a wrong ``ETCD_ENDPOINTS`` fails the start; NATS connects in the background),
``close()`` in reverse order, idempotent.
"""
from __future__ import annotations

import asyncio
import logging

from kvbm_client.bus import NatsBus, events_subject, nats_auth
from kvbm_client.config import KvbmConfig
from kvbm_client.discovery import EtcdRegistration, describe_self, leader_key

from .commands import create as create_commands
from .events import KvEventPublisher
from .service import LeaderService

log = logging.getLogger("kvbm.leader")
REFRESH_SECONDS = 0.5  # how often the leader's etcd record is brought up to date


class LeaderCluster:
    """Owns the leader's etcd lease and NATS connection; see the module docstring."""

    def __init__(self, config: KvbmConfig, service: LeaderService, address: str) -> None:
        self.config = config
        self.service = service
        self.address = address
        self.node = config.resolved_node_name
        self.etcd: EtcdRegistration | None = None
        self.bus: NatsBus | None = None
        self._refresher: asyncio.Task | None = None
        self._closed = False

    def record(self) -> dict:
        svc = self.service
        plan = svc.membership.plan
        return describe_self("leader", leader_id=svc.leader_id, node=self.node, endpoint=self.address,
                             ready=svc.membership.ready,
                             capacity={"G2": plan.host_slots if plan else 0, "G3": plan.disk_slots if plan else 0},
                             workers=sorted(svc.membership.workers), expected=list(svc.membership.expected),
                             nats=bool(self.config.nats_server))

    async def start(self) -> None:
        cfg = self.config
        if cfg.etcd_endpoints:
            self.etcd = EtcdRegistration(cfg.etcd_endpoints, cfg.etcd_lease_ttl_secs)
            await self.etcd.start()
            await self.etcd.put(leader_key(self.node), self.record())
            self._refresher = asyncio.ensure_future(self._refresh())
            log.info("registered in etcd %s as %s (lease TTL %ds)", cfg.etcd_endpoints, leader_key(self.node),
                     cfg.etcd_lease_ttl_secs)
        if cfg.nats_server:
            self.bus = NatsBus(cfg.nats_server, f"kvbm-leader-{self.node}", nats_auth(cfg))
            await self.bus.start()
            old = self.service.commands
            self.service.commands = create_commands("nats", bus=self.bus, node=self.node)
            await old.close()
            publisher = KvEventPublisher(self.bus, events_subject(self.node), self.node, self.service.leader_id,
                                         cfg.event_buffer, self.service.metrics)
            publisher.start()
            self.service.events = publisher
            log.info("NATS %s: commands on kvbm.v1.commands.%s.<worker>, KV events on %s", cfg.nats_server,
                     self.node, events_subject(self.node))

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await self.etcd.put(leader_key(self.node), self.record())  # no-op when unchanged
            except Exception:
                log.exception("etcd record refresh")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
        if self.bus is not None:
            await self.service.events.close()
            await self.bus.close()
        if self.etcd is not None:
            await self.etcd.close()
