"""GPU tests: run on a machine with CUDA, torch and cuda-python (``pytest tests/gpu``); every
module skips cleanly elsewhere. Daemons run as child processes on real unix sockets."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_support import cuda_ready  # noqa: F401  (re-exported for the fixtures)


class GpuNode:
    """A leader and one ``--gpu 0`` worker; the test process is the engine."""

    def __init__(self, root: Path, worker_args: tuple[str, ...] = (), **env: str) -> None:
        self.root = root
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_KVBM_")}
        self.env.update(DYN_KVBM_SOCKET_DIR=str(root / "sock"), DYN_KVBM_DISK_CACHE_DIR=str(root / "disk"),
                        DYN_LOG="debug", PYTHONUNBUFFERED="1", DYN_KVBM_HOST_FREE_WATERMARK="0")
        self.env.update({k: str(v) for k, v in env.items()})
        log = open(root / "daemons.log", "ab")
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "kvbm_leader"], env=self.env, stdout=log, stderr=log),
            subprocess.Popen([sys.executable, "-m", "kvbm_worker", "--gpu", "0", "--no-nixl", *worker_args],
                             env=self.env, stdout=log, stderr=log)]
        self.clients = []

    def client(self):
        from kvbm_client import KvbmClient, KvbmConfig
        c = KvbmClient(KvbmConfig.from_env(self.env), timeout=60)
        self.clients.append(c)
        end = time.monotonic() + 120  # the GPU worker imports torch and creates its context first
        while "0" not in c.workers:
            assert time.monotonic() < end and self.procs[1].poll() is None, self.log()[-3000:]
            time.sleep(0.2)
            c.refresh_workers()
        return c

    def log(self) -> str:
        return (self.root / "daemons.log").read_text(errors="replace")

    def stop(self) -> None:
        for c in self.clients:
            try:
                c.close()
            except Exception:
                pass
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def gpu_node(tmp_path):
    nodes = []

    def factory(*worker_args: str, **env) -> GpuNode:
        root = tmp_path / f"node{len(nodes)}"
        root.mkdir()
        nodes.append(GpuNode(root, worker_args, **env))
        return nodes[-1]
    yield factory
    for n in nodes:
        n.stop()
