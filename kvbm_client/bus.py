"""The NATS side of the cluster plane: subjects and one reconnecting connection per process.

Used by the leader (commands out, KV events out) and the workers (commands in); only when
``NATS_SERVER`` is set. ``nats-py`` is imported lazily.

Subjects (versioned; ``<node>`` is ``DYN_KVBM_NODE_NAME``, default the host name):

    kvbm.v1.commands.<node>.<worker>   request/reply: a serialized ``CommandRequest`` (a signed
                                       plan); the reply is a serialized ``CommandResponse``,
                                       the worker's acknowledgement
    kvbm.v1.events.<node>              KV events for KV-aware routers, JSON (see
                                       :mod:`kvbm_leader.events`)
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from .config import KvbmConfig

log = logging.getLogger("kvbm.bus")


def commands_subject(node: str, worker_id: str) -> str:
    return f"kvbm.v1.commands.{node}.{worker_id}"


def events_subject(node: str) -> str:
    return f"kvbm.v1.events.{node}"


def nats_auth(config: "KvbmConfig") -> dict[str, Any]:
    """nats-py connect options for the configured credentials, nkey seed and TLS CA."""
    out: dict[str, Any] = {}
    if config.nats_creds:
        out["user_credentials"] = config.nats_creds
    if config.nats_nkey_seed:
        out["nkeys_seed"] = config.nats_nkey_seed
    if config.nats_tls_ca:
        import ssl
        out["tls"] = ssl.create_default_context(cafile=config.nats_tls_ca)
    return out


class NatsBus:
    """A NATS connection that comes up in the background and reconnects by itself.

    Runs in any role. ``start()`` never blocks on an absent server (a daemon started before
    nats-server keeps serving; commands fall back to "not delivered" meanwhile); subscriptions
    made with :meth:`subscribe` are restored by nats-py after a reconnect. ``close()`` is
    idempotent.
    """

    def __init__(self, servers: str, name: str, auth: dict[str, Any] | None = None) -> None:
        self.servers = [s.strip() for s in servers.split(",") if s.strip()]
        self.name = name
        self.auth = auth or {}  # nats.connect keywords: user_credentials, nkeys_seed, tls
        self.nc: Any = None  # nats.aio.client.Client once connected (nats-py is imported lazily)
        self.reconnects = 0
        self._subs: list[tuple[str, Callable[..., Awaitable[None]]]] = []
        self._task: asyncio.Task | None = None
        self._up = asyncio.Event()
        self._closed = False

    @property
    def is_connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("NatsBus.start() called twice")
        self._task = asyncio.ensure_future(self._connect())

    async def wait_connected(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._up.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def _connect(self) -> None:
        import nats  # lazy: only the cluster mode needs it

        async def disconnected() -> None:
            log.warning("NATS disconnected; reconnecting")

        async def reconnected() -> None:
            self.reconnects += 1
            log.info("NATS reconnected to %s", self.nc.connected_url.netloc if self.nc.connected_url else "?")

        async def error(exc: Exception) -> None:
            log.debug("NATS: %s", exc)

        nc = await nats.connect(self.servers, name=self.name, allow_reconnect=True, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.25, connect_timeout=1, ping_interval=2,
                                max_outstanding_pings=2, disconnected_cb=disconnected,
                                reconnected_cb=reconnected, error_cb=error, **self.auth)
        self.nc = nc
        for subject, handler in self._subs:
            await nc.subscribe(subject, cb=handler)
        self._up.set()
        log.info("NATS connected to %s", ",".join(self.servers))

    async def subscribe(self, subject: str, handler: Callable[..., Awaitable[None]]) -> None:
        self._subs.append((subject, handler))
        if self.nc is not None:
            await self.nc.subscribe(subject, cb=handler)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.nc is not None:
            try:
                await asyncio.wait_for(self.nc.close(), 2)
            except Exception as exc:
                log.debug("NATS close: %s", exc)
