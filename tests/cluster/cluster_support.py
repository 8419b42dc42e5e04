"""Real etcd and nats-server processes on free loopback ports, with temp data dirs.

Started and stopped by PID (never by name); ``stop(kill=True)`` is a kill -9, ``start()``
after a stop restarts the server on the same ports (and, unless wiped, the same data).
"""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

READY_TIMEOUT = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def binary(name: str) -> str | None:
    for path in (f"/usr/bin/{name}", f"/usr/sbin/{name}", shutil.which(name)):
        if path and Path(path).exists():
            return path
    return None


class _Server:
    name = ""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} already running"
        log = open(self.root / f"{self.name}.out", "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + READY_TIMEOUT
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"{self.name} did not start; see {self.root}")
            time.sleep(0.02)

    def stop(self, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self, kill: bool = True, down_for: float = 0.0) -> None:
        self.stop(kill)
        time.sleep(down_for)
        self.start()
        self.restarts += 1


class EtcdServer(_Server):
    name = "etcd"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.port, self.peer_port = free_port(), free_port()

    @property
    def endpoints(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wipe(self) -> None:
        shutil.rmtree(self.root / "data", ignore_errors=True)

    def command(self) -> list[str]:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        return [binary("etcd"), "--name", "ci", "--data-dir", str(self.root / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"ci={peer}", "--heartbeat-interval=10", "--election-timeout=100",
                "--unsafe-no-fsync", "--logger", "zap", "--log-outputs", str(self.root / "etcd.log")]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoints}/health", timeout=0.5) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False


class NatsServer(_Server):
    name = "nats"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.port, self.monitor_port = free_port(), free_port()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [binary("nats-server"), "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor_port),
                "-l", str(self.root / "nats.log")]

    def ready(self) -> bool:
        return _port_open(self.port)


def run_async(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll until ``predicate()``; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(interval)
    return time.monotonic() - start


class NatsSubscriber:
    """A NATS subscription on a private loop thread (the tests themselves are synchronous);
    subclasses handle each message in :meth:`on_msg`, on that thread."""

    def __init__(self, url: str, subject: str) -> None:
        self.url, self.subject = url, subject
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._nc = asyncio.run_coroutine_threadsafe(self._connect(), self._loop).result(10)

    async def _connect(self):
        import nats

        nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        await nc.subscribe(self.subject, cb=self.on_msg)
        await nc.flush()  # subscribed at the server before the constructor returns
        return nc

    async def on_msg(self, msg) -> None:
        raise NotImplementedError

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._nc.close(), self._loop).result(5)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class EventCollector(NatsSubscriber):
    """Keeps every message of a NATS subject (JSON)."""

    def __init__(self, url: str, subject: str) -> None:
        self.messages: list[dict] = []
        super().__init__(url, subject)

    async def on_msg(self, msg) -> None:
        self.messages.append(json.loads(msg.data))

    def of_kind(self, kind: str) -> list[dict]:
        return [m for m in list(self.messages) if m["kind"] == kind]

    def stored_hashes(self) -> set[str]:
        return {b["block_hash"] for m in self.of_kind("stored") for b in m["blocks"]}

