"""Fixtures that run the real daemons as child processes on real unix sockets."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import grpc
import numpy as np
import pytest

from kvbm_client import KvbmClient, KvbmConfig, ShmKvBuffer
from kvbm_client.contract import pb, rpc

READY_TIMEOUT = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> Callable[[], int]:
    return _free_port


@dataclass
class Node:
    """One node: a leader and its workers, each a child process."""

    root: Path
    env: dict[str, str]
    num_workers: int
    leader: subprocess.Popen | None = None
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    buffers: list[ShmKvBuffer] = field(default_factory=list)
    clients: list[KvbmClient] = field(default_factory=list)

    @property
    def socket_dir(self) -> Path:
        return Path(self.env["DYN_KVBM_SOCKET_DIR"])

    @property
    def disk_dir(self) -> Path:
        return Path(self.env["DYN_KVBM_DISK_CACHE_DIR"])

    @property
    def leader_address(self) -> str:
        return f"unix:{self.socket_dir / 'leader.sock'}"

    def _log(self, name: str):
        return open(self.root / f"{name}.log", "ab")

    def start_leader(self, *extra: str) -> subprocess.Popen:
        self.leader = subprocess.Popen([sys.executable, "-m", "kvbm_leader", "--num-workers", str(self.num_workers),
                                        *extra], env=self.env, stdout=self._log("leader"), stderr=subprocess.STDOUT)
        return self.leader

    def start_worker(self, worker_id: str, *extra: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "kvbm_worker", "--worker-id", worker_id, "--cpu", *extra],
                                env=self.env, stdout=self._log(f"worker-{worker_id}"), stderr=subprocess.STDOUT)
        self.workers[worker_id] = proc
        return proc

    def start(self) -> "Node":
        self.start_leader()
        for i in range(self.num_workers):
            self.start_worker(str(i))
        self.wait_attached()
        return self

    def status(self, timeout: float = 2.0) -> "pb.StatusResponse":
        with grpc.insecure_channel(self.leader_address) as channel:
            return rpc.LeaderStub(channel).Status(pb.StatusRequest(), timeout=timeout)

    def wait_attached(self, n: int | None = None, timeout: float = READY_TIMEOUT) -> None:
        n = self.num_workers if n is None else n
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if len(self.status().workers) >= n:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{n} workers did not attach; logs in {self.root}")

    def config(self) -> KvbmConfig:
        return KvbmConfig.from_env(self.env)

    def client(self, name: str = "test") -> KvbmClient:
        c = KvbmClient(self.config(), client_name=name)
        self.clients.append(c)
        return c

    def engine(self, num_blocks: int = 64, num_layers: int = 4, page_bytes: int = 2048, seed: int = 0) -> ShmKvBuffer:
        """A fake engine KV cache in shared memory, filled with a known pattern."""
        buf = ShmKvBuffer(num_blocks, num_layers, page_bytes, directory=str(self.root))
        buf.array[:] = np.random.default_rng(seed).integers(0, 256, buf.array.shape, dtype=np.uint8)
        self.buffers.append(buf)
        return buf

    def ready_client(self, num_blocks: int = 64, num_layers: int = 4, page_bytes: int = 2048
                     ) -> tuple[KvbmClient, dict[str, ShmKvBuffer]]:
        """A client with one engine buffer registered on every worker, pools allocated."""
        c = self.client()
        engines = {}
        for i in range(self.num_workers):
            engines[str(i)] = self.engine(num_blocks, num_layers, page_bytes, seed=i)
            c.register_region(str(i), engines[str(i)].spec())
        c.wait_ready(READY_TIMEOUT)
        return c, engines

    def signal_worker(self, worker_id: str, sig: int) -> int:
        proc = self.workers[worker_id]
        proc.send_signal(sig)
        return proc.wait(15)

    def stop(self) -> None:
        for c in self.clients:
            try:
                c.close()
            except Exception:
                pass
        procs = [*self.workers.values(), self.leader]
        for p in procs:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            if p is None:
                continue
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for b in self.buffers:
            b.close()


def node_env(root: Path, overrides: dict, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a test node's daemons: this process's, minus any DYN_KVBM_* (and
    ``drop``), plus test defaults and ``overrides``; an override of "" unsets a variable."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("DYN_KVBM_") and k not in drop}
    base.update({"DYN_KVBM_SOCKET_DIR": str(root / "sock"), "DYN_KVBM_DISK_CACHE_DIR": str(root / "disk"),
                 "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "32", "DYN_LOG": "debug",
                 "DYN_KVBM_JOB_TIMEOUT_SECS": "5", "PYTHONUNBUFFERED": "1"})
    base.update({k: str(v) for k, v in overrides.items()})
    return {k: v for k, v in base.items() if v != ""}


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """Factory: ``make_node(num_workers=1, start=True, **DYN_KVBM_* overrides)``."""
    nodes: list[Node] = []

    def factory(num_workers: int = 1, start: bool = True, **env: str) -> Node:
        root = tmp_path / f"node{len(nodes)}"
        root.mkdir()
        node = Node(root, node_env(root, env), num_workers)
        nodes.append(node)
        return node.start() if start else node

    yield factory
    for node in nodes:
        node.stop()
