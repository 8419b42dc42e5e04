"""Fixtures that run the real daemons as child processes on real unix sockets."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from kvbm_client import KvbmClient, ShmKvBuffer
from kvbm_client.local_node import READY_TIMEOUT, LocalNode, isolated_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> Callable[[], int]:
    return _free_port


class Node(LocalNode):
    """One node (a leader and its workers as child processes, logs in ``root``) and the test's
    engine buffers and clients, closed with it."""

    def __init__(self, root: Path, env: dict[str, str], num_workers: int, worker_args: tuple[str, ...] = ()) -> None:
        super().__init__(env, num_workers, log_dir=root, worker_args=worker_args)
        self.root = root
        self.buffers: list[ShmKvBuffer] = []
        self.clients: list[KvbmClient] = []

    @property
    def socket_dir(self) -> Path:
        return Path(self.env["DYN_KVBM_SOCKET_DIR"])

    @property
    def disk_dir(self) -> Path:
        return Path(self.env["DYN_KVBM_DISK_CACHE_DIR"])

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
        for worker_id in self.devices:
            engines[worker_id] = self.engine(num_blocks, num_layers, page_bytes, seed=int(worker_id))
            c.register_region(worker_id, engines[worker_id].spec())
        c.wait_ready(READY_TIMEOUT)
        return c, engines

    def stop(self, timeout: float = 15.0) -> None:
        for c in self.clients:
            try:
                c.close()
            except Exception:
                pass
        super().stop(timeout)
        for b in self.buffers:
            b.close()


def node_env(root: Path, overrides: dict, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a test node's daemons: this process's, minus any DYN_KVBM_* (and
    ``drop``), plus test defaults and ``overrides``; an override of "" unsets a variable."""
    return isolated_env(root, {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "32", "DYN_LOG": "debug",
                               "DYN_KVBM_JOB_TIMEOUT_SECS": "5", **overrides}, drop)


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """Factory: ``make_node(num_workers=1, start=True, worker_args=(), **DYN_KVBM_* overrides)``."""
    nodes: list[Node] = []

    def factory(num_workers: int = 1, start: bool = True, worker_args: tuple[str, ...] = (), **env: str) -> Node:
        root = tmp_path / f"node{len(nodes)}"
        root.mkdir()
        node = Node(root, node_env(root, env), num_workers, worker_args)
        nodes.append(node)
        return node.start() if start else node

    yield factory
    for node in nodes:
        node.stop()
