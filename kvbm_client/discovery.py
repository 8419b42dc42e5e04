"""Cluster discovery through etcd: which leader serves each node, and its workers.

Used by all three roles (leader and workers register, connectors and tools look up); only
when ``ETCD_ENDPOINTS`` is set. ``aetcd`` is imported lazily, so the embedded single-node
mode needs no etcd client at all.

Key layout (versioned prefix; values are JSON objects):

    /kvbm/v1/nodes/<node>/leader          {"leader_id", "endpoint", "pid", "capacity", "workers"}
    /kvbm/v1/nodes/<node>/workers/<id>    {"worker_id", "rank", "endpoint", "pid"}

Every key hangs on its owner's lease (TTL ``DYN_KVBM_ETCD_LEASE_TTL_SECS``, kept alive every
TTL/3), so the keys of a process killed with -9 vanish within one TTL. When the lease is
lost (etcd restarted without its data, or unreachable for longer than the TTL) a new one is
granted and every key is put again.

NOTE: aetcd replaces the design's ``etcd3`` package, which does not import with protobuf >= 4.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator
from urllib.parse import urlparse

from .config import KvbmConfig

log = logging.getLogger("kvbm.discovery")

PREFIX = "/kvbm/v1/nodes/"
CALL_TIMEOUT = 2


def node_prefix(node: str) -> str:
    return f"{PREFIX}{node}/"


def leader_key(node: str) -> str:
    return f"{node_prefix(node)}leader"


def worker_key(node: str, worker_id: str) -> str:
    return f"{node_prefix(node)}workers/{worker_id}"


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``http://h:p,h2:p2`` -> ``[(h, p), (h2, p2)]``."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        url = urlparse(item if "://" in item else "http://" + item)
        out.append((url.hostname or "127.0.0.1", url.port or 2379))
    if not out:
        raise ValueError(f"no etcd endpoint in {text!r}")
    return out


def _client(endpoints: str):
    import aetcd  # lazy: only the cluster mode needs it

    # NOTE: aetcd talks to one endpoint; the first one is used (a single local etcd, or a
    # load-balanced address, in the deployments we target).
    host, port = parse_endpoints(endpoints)[0]
    return aetcd.Client(host=host, port=port, timeout=CALL_TIMEOUT)


def _etcd_errors() -> tuple[type[BaseException], ...]:
    import aetcd.exceptions
    import grpc

    return (aetcd.exceptions.ClientError, grpc.RpcError, asyncio.TimeoutError, OSError)


class EtcdRegistration:
    """One process's lease and the keys it owns; runs in the leader and worker daemons.

    Lifecycle: ``start()`` connects and grants the lease (raises if etcd is unreachable, so a
    misconfigured daemon fails at startup), ``put()`` records a key, ``close()`` revokes the
    lease (the keys go at once) and is idempotent.
    """

    def __init__(self, endpoints: str, ttl: int) -> None:
        self.endpoints = endpoints
        self.ttl = ttl
        self.keys: dict[str, bytes] = {}
        self.regrants = 0  # leases re-granted after a loss (tests and logs)
        self._client: Any = None  # aetcd.Client once started (aetcd is imported lazily)
        self._lease: Any = None  # its aetcd lease
        self._task: asyncio.Task | None = None
        self._closed = False

    async def start(self) -> None:
        if self._client is not None:
            raise RuntimeError("EtcdRegistration.start() called twice")
        self._client = _client(self.endpoints)
        await self._client.connect()
        self._lease = await self._client.lease(self.ttl)
        self._task = asyncio.ensure_future(self._keepalive())

    async def put(self, key: str, value: dict[str, Any]) -> None:
        data = json.dumps(value, sort_keys=True).encode()
        if self.keys.get(key) == data:
            return
        self.keys[key] = data
        try:
            await self._client.put(key.encode(), data, lease=self._lease)
        except _etcd_errors() as exc:  # the keepalive loop puts it again once etcd is back
            log.warning("etcd put %s failed: %s", key, exc)

    async def _regrant(self) -> None:
        self._lease = await self._client.lease(self.ttl)
        for key, data in self.keys.items():
            await self._client.put(key.encode(), data, lease=self._lease)
        self.regrants += 1
        log.warning("etcd lease lost; re-registered %d keys under lease %x", len(self.keys), self._lease.id)

    async def _keepalive(self) -> None:
        failing = False
        while not self._closed:
            await asyncio.sleep(self.ttl / 3)
            try:
                reply = await self._lease.refresh()
                if reply is None or reply.TTL <= 0:
                    await self._regrant()
                elif failing:  # back after an outage with the lease intact: keys may still be gone
                    for key, data in self.keys.items():
                        await self._client.put(key.encode(), data, lease=self._lease)
                    log.info("etcd reachable again; lease %x kept", self._lease.id)
                failing = False
            except _etcd_errors() as exc:
                if not failing:
                    log.warning("etcd keepalive failed (%s); retrying every %.1fs", type(exc).__name__,
                                self.ttl / 3)
                failing = True
            except Exception:  # never let a bug stop the keepalive for good
                log.exception("etcd keepalive")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        if self._client is not None:
            try:
                if self._lease is not None:
                    await asyncio.wait_for(self._lease.revoke(), CALL_TIMEOUT)
            except Exception as exc:  # etcd down at shutdown: the lease expires by itself
                log.debug("lease revoke failed: %s", exc)
            try:
                await asyncio.wait_for(self._client.close(), CALL_TIMEOUT)
            except Exception:
                pass


@dataclass
class NodeInfo:
    """What etcd says about one node."""

    node: str
    leader: dict[str, Any] | None = None
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)


def _apply(nodes: dict[str, NodeInfo], key: str, value: dict | None) -> None:
    rest = key[len(PREFIX):].split("/")
    if len(rest) < 2:
        return
    info = nodes.setdefault(rest[0], NodeInfo(rest[0]))
    if rest[1] == "leader":
        info.leader = value
    elif rest[1] == "workers" and len(rest) == 3:
        if value is None:
            info.workers.pop(rest[2], None)
        else:
            info.workers[rest[2]] = value
    if info.leader is None and not info.workers:
        nodes.pop(rest[0], None)


async def list_nodes(endpoints: str) -> dict[str, NodeInfo]:
    """Every node registered in etcd (one read)."""
    client = _client(endpoints)
    try:
        await client.connect()
        nodes: dict[str, NodeInfo] = {}
        for kv in await client.get_prefix(PREFIX.encode()):
            _apply(nodes, kv.key.decode(), json.loads(kv.value))
        return nodes
    finally:
        await client.close()


async def lookup_leader(config: KvbmConfig, timeout: float) -> dict[str, Any]:
    """The node's leader record, waiting up to ``timeout`` for it to register (for processes
    started independently, systemd-style). Raises ``TimeoutError``."""
    assert config.etcd_endpoints, "lookup_leader needs ETCD_ENDPOINTS"
    key = leader_key(config.resolved_node_name).encode()
    client = _client(config.etcd_endpoints)
    end = time.monotonic() + timeout
    try:
        while True:
            try:
                await client.connect()
                found = await client.get(key)
                if found is not None:
                    return json.loads(found.value)
            except _etcd_errors() as exc:
                log.debug("leader lookup: %s", exc)
            if time.monotonic() >= end:
                raise TimeoutError(f"no leader of node {config.resolved_node_name!r} registered in etcd "
                                   f"({config.etcd_endpoints}) within {timeout:g}s")
            await asyncio.sleep(0.1)
    finally:
        await client.close()


class PrefixWatch:
    """Follows every key under a prefix: a snapshot first, then changes, forever.

    Runs wherever a process needs a live view (tools, routers, tests). Each (re)connection
    reads the prefix and reports how it differs from the view so far, then follows changes from
    that read's revision: after an etcd error (restart, lost connection, lost data, compaction)
    the view is never stale, while changes made during the outage arrive as their net
    difference. A key put again with the value the view holds is no change.

    NOTE: resuming from the last seen revision instead is not safe: an etcd that lost its data
    counts revisions from 1 again, and once its keys were re-put past the old revision before
    the watch came back, the puts in between were skipped (seen in CI: a leader re-registered
    after a wipe and the watch never saw it).
    """

    def __init__(self, endpoints: str, prefix: str = PREFIX) -> None:
        self.endpoints = endpoints
        self.prefix = prefix
        self.revision = 0  # last revision seen
        self.recreated = 0  # watches re-created after an error
        self.known: dict[str, bytes] = {}

    async def events(self) -> AsyncIterator[tuple[str, str, dict | None]]:
        """Yields ``("put" | "delete", key, value or None)``."""
        client = _client(self.endpoints)
        backoff = 0.1
        try:
            while True:
                try:
                    await client.connect()
                    async for item in self._follow(client):
                        backoff = 0.1
                        yield item
                    why = "stream ended"
                except _etcd_errors() as exc:
                    why = type(exc).__name__
                log.info("etcd watch on %s broke (%s); re-reading it and following from there", self.prefix,
                         why)
                self.recreated += 1
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
        finally:
            await client.close()

    async def _follow(self, client) -> AsyncIterator[tuple[str, str, dict | None]]:
        snapshot = await client.get_prefix(self.prefix.encode())
        current = {kv.key.decode(): kv.value for kv in snapshot}
        for key in [k for k in self.known if k not in current]:
            del self.known[key]
            yield "delete", key, None
        for key, value in current.items():
            if self.known.get(key) != value:
                self.known[key] = value
                yield "put", key, json.loads(value)
        self.revision = snapshot.header.revision
        watch = await client.watch_prefix(self.prefix.encode(), start_revision=self.revision + 1)
        try:
            async for event in watch:
                self.revision = max(self.revision, event.kv.mod_revision)
                key = event.kv.key.decode()
                if event.kind == "PUT":
                    self.known[key] = event.kv.value
                    yield "put", key, json.loads(event.kv.value)
                else:
                    self.known.pop(key, None)
                    yield "delete", key, None
        finally:
            try:
                await asyncio.wait_for(watch.cancel(), CALL_TIMEOUT)
            except Exception:
                pass


def describe_self(role: str, **extra: Any) -> dict[str, Any]:
    return {"role": role, "pid": os.getpid(), **extra}
