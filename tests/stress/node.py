"""A kvbm node (leader + one CPU worker) as child processes, for the stress harness.

Runs in the harness (kvbm venv). The worker is started through ``faulty_worker.py``, which
is the real daemon plus the test-only fault hooks its environment asks for (none by default).
The node can SIGSTOP/SIGCONT, kill -9 and restart either daemon, as ``kvbm serve`` would
restart them, and keeps the leader's counters across leader restarts (``totals``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import grpc

FAULTY_WORKER = Path(__file__).with_name("faulty_worker.py")
REPO = Path(__file__).resolve().parents[2]


class Daemon(str, Enum):
    LEADER = "leader"
    WORKER = "worker"


@dataclass(frozen=True)
class NodeConfig:
    """Tier sizes and timeouts of the node under test (``DYN_KVBM_*``)."""

    g2_blocks: int = 48
    g3_blocks: int = 512
    job_timeout_s: float = 30.0
    no_nixl: bool = False
    log_level: str = "info"
    #: the worker's test-only faults: KVBM_STRESS_DISK_EIO, KVBM_STRESS_STALL (see faulty_worker.py)
    worker_faults: tuple[tuple[str, str], ...] = ()
    #: GPU engine (vLLM 0.26): the worker serves CUDA device ``gpu`` (``--gpu``) instead of ``--cpu``
    gpu: int | None = None
    #: the checkout whose daemons run (another branch's fix) [default: $KVBM_STRESS_SRC, else this one]
    src: str = os.environ.get("KVBM_STRESS_SRC", "")

    def env(self, root: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_KVBM_", "KVBM_STRESS_", "KVBM_FAULT_"))}
        env.update(DYN_KVBM_SOCKET_DIR=str(root / "sock"), DYN_KVBM_DISK_CACHE_DIR=str(root / "disk"),
                   DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS=str(self.g2_blocks),
                   DYN_KVBM_JOB_TIMEOUT_SECS=str(self.job_timeout_s), DYN_LOG=self.log_level,
                   PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [self.src or str(REPO), env.get("PYTHONPATH")])),
                   KVBM_STRESS_FAULT_LOG=str(root / "faults.log"))
        if self.g3_blocks:
            env["DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"] = str(self.g3_blocks)
        env.update(dict(self.worker_faults))
        return env


@dataclass
class StressNode:
    root: Path
    config: NodeConfig
    env: dict = field(default_factory=dict)
    procs: dict = field(default_factory=dict)
    carried: dict = field(default_factory=dict)  # counters of leaders that were killed
    restarts: dict = field(default_factory=lambda: {Daemon.LEADER: 0, Daemon.WORKER: 0})

    def __post_init__(self) -> None:
        (self.root / "disk").mkdir(parents=True, exist_ok=True)
        self.env = self.config.env(self.root)

    # ------------------------------------------------------------------ processes
    def start(self, what: Daemon) -> None:
        if what is Daemon.LEADER:
            argv = [sys.executable, "-m", "kvbm_leader"]
        else:
            device = ["--cpu"] if self.config.gpu is None else ["--gpu", str(self.config.gpu)]
            argv = [sys.executable, str(FAULTY_WORKER), "--worker-id", "0", *device]
            if self.config.no_nixl:
                argv.append("--no-nixl")
        log = open(self.root / f"{what.value}.log", "ab")
        self.procs[what] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=self.config.src or REPO)

    def start_all(self, timeout: float = 60.0) -> "StressNode":
        self.start(Daemon.LEADER)
        self.start(Daemon.WORKER)
        self.wait_attached(timeout)
        return self

    def pid(self, what: Daemon) -> int:
        return self.procs[what].pid

    def signal(self, what: Daemon, sig: int) -> None:
        self.procs[what].send_signal(sig)

    def kill(self, what: Daemon) -> None:
        """kill -9, after saving a leader's counters (they die with it)."""
        if what is Daemon.LEADER:
            self._carry()
        proc = self.procs[what]
        proc.send_signal(signal.SIGKILL)
        proc.wait(15)

    def restart(self, what: Daemon) -> None:
        self.restarts[what] += 1
        self.start(what)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped daemon cannot act on SIGTERM
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # ------------------------------------------------------------------ status
    @property
    def leader_address(self) -> str:
        return f"unix:{self.root / 'sock' / 'leader.sock'}"

    def status(self, timeout: float = 5.0):
        from kvbm_client.contract import pb, rpc
        with grpc.insecure_channel(self.leader_address) as channel:
            return rpc.LeaderStub(channel).Status(pb.StatusRequest(), timeout=timeout)

    def worker_status(self, timeout: float = 5.0):
        from kvbm_client.contract import pb, rpc
        with grpc.insecure_channel(f"unix:{self.root / 'sock' / 'worker-0.sock'}") as channel:
            return rpc.WorkerStub(channel).Status(pb.WorkerStatusRequest(), timeout=timeout)

    def wait_attached(self, timeout: float = 60.0) -> None:
        self._wait(lambda s: len(s.workers) >= 1, timeout, "the worker did not attach")

    def wait_ready(self, timeout: float = 60.0) -> None:
        self._wait(lambda s: s.state == "ready", timeout, "the node is not ready")

    def _wait(self, done, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if done(self.status(timeout=2)):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{what} within {timeout:g}s; logs in {self.root}")

    def _carry(self) -> None:
        try:
            counters = dict(self.status(timeout=2).counters)
        except grpc.RpcError:
            return
        for name, value in counters.items():
            self.carried[name] = self.carried.get(name, 0) + value

    def totals(self) -> dict[str, float]:
        """The leader's counters summed over every leader process of this run."""
        totals = dict(self.carried)
        try:
            for name, value in self.status().counters.items():
                totals[name] = totals.get(name, 0) + value
        except grpc.RpcError:
            pass
        return totals

    def injected_faults(self) -> list[str]:
        path = self.root / "faults.log"
        return path.read_text().splitlines() if path.exists() else []
