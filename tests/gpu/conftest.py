"""GPU tests: run on a machine with CUDA, torch and cuda-python (``pytest tests/gpu``); every
module skips cleanly elsewhere. Daemons run as child processes on real unix sockets."""
from __future__ import annotations

import os

# GPU layer waits need eager module loading (kvbm_client/signal_page.py); set before CUDA starts
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from gpu_support import GPU_READY_TIMEOUT, cuda_ready  # noqa: F401  (re-exported for the fixtures)
from kvbm_client.local_node import LocalNode, isolated_env


class GpuNode(LocalNode):
    """A leader and one ``--gpu 0`` worker (logs in ``root``); the test process is the engine."""

    def __init__(self, root: Path, worker_args: tuple[str, ...] = (), **env: str) -> None:
        super().__init__(isolated_env(root, {"DYN_LOG": "debug", "DYN_KVBM_HOST_FREE_WATERMARK": "0", **env}),
                         gpus=[0], worker_args=("--no-nixl", *worker_args), log_dir=root)
        self.root = root
        self.clients: list[Any] = []
        self.start(wait=False)

    def client(self) -> Any:
        from kvbm_client import KvbmClient
        self.wait_attached(timeout=GPU_READY_TIMEOUT)  # fails at once if a daemon died
        c = KvbmClient(self.config(), timeout=60)
        self.clients.append(c)
        return c

    def log(self) -> str:
        return self.log_tails(chars=1 << 20)

    def stop(self, timeout: float = 20.0) -> None:
        for c in self.clients:
            try:
                c.close()
            except Exception:
                pass
        super().stop(timeout)


@pytest.fixture
def gpu_node(tmp_path: Path) -> Iterator[Callable[..., GpuNode]]:
    nodes: list[GpuNode] = []

    def factory(*worker_args: str, **env: str) -> GpuNode:
        root = tmp_path / f"node{len(nodes)}"
        root.mkdir()
        nodes.append(GpuNode(root, worker_args, **env))
        return nodes[-1]
    yield factory
    for n in nodes:
        n.stop()
