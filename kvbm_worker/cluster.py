"""The worker's cluster plane: etcd registration and leader discovery, NATS commands.

Runs in the worker daemon, on its event loop; only what is configured starts. With etcd and
no explicit ``--leader``, the leader's address is read from etcd before every attach, so a
worker started before its leader (systemd-style) waits for it, up to
``DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS``, and a restarted leader is found again.
Lifecycle: ``start()`` / ``close()`` (reverse order, idempotent).
"""
from __future__ import annotations

import logging

from kvbm_client.bus import NatsBus, nats_auth
from kvbm_client.config import KvbmConfig
from kvbm_client.discovery import EtcdRegistration, describe_self, lookup_leader, worker_key

from .commands.nats import Acknowledge, NatsCommandServer

log = logging.getLogger("kvbm.worker")


class WorkerCluster:
    """Owns the worker's etcd lease and NATS subscription; see the module docstring."""

    def __init__(self, config: KvbmConfig, worker_id: str, rank: int, address: str, discover_leader: bool,
                 acknowledge: Acknowledge) -> None:
        self.config = config
        self.worker_id, self.rank = worker_id, rank
        self._acknowledge = acknowledge
        self.address = address
        self.node = config.resolved_node_name
        self.discover_leader = discover_leader and bool(config.etcd_endpoints)
        self.etcd: EtcdRegistration | None = None
        self.bus: NatsBus | None = None
        self.commands: NatsCommandServer | None = None
        self._closed = False

    async def start(self) -> None:
        cfg = self.config
        if cfg.etcd_endpoints:
            self.etcd = EtcdRegistration(cfg.etcd_endpoints, cfg.etcd_lease_ttl_secs)
            await self.etcd.start()
            await self.etcd.put(worker_key(self.node, self.worker_id),
                                describe_self("worker", worker_id=self.worker_id, rank=self.rank,
                                              node=self.node, endpoint=self.address))
            log.info("registered in etcd as %s", worker_key(self.node, self.worker_id))
        if cfg.nats_server:
            self.bus = NatsBus(cfg.nats_server, f"kvbm-worker-{self.node}-{self.worker_id}", nats_auth(cfg))
            self.commands = NatsCommandServer(self.bus, self.node, self.worker_id, self._acknowledge)
            await self.commands.start()
            await self.bus.start()
            log.info("taking leader commands on NATS %s", self.commands.subject)

    async def leader_address(self, timeout: float) -> str | None:
        """The leader's address from etcd (waits for it to register), or None without discovery."""
        if not self.discover_leader:
            return None
        record = await lookup_leader(self.config, timeout)
        return str(record["endpoint"])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.bus is not None:
            await self.bus.close()
        if self.etcd is not None:
            await self.etcd.close()
