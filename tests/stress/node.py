"""A kvbm node (leader + one worker) for the stress harness: a :class:`LocalNode` plus what a
stress pass needs on top of it.

Runs in the harness (kvbm venv). The daemons are the real ones; test-only faults come from
the one fault wrapper of the test suite (``tests/support/faults``, variables
``KVBM_FAULT_*``), installed only when the pass asks for one. On top of
:class:`~kvbm_client.local_node.LocalNode`: SIGSTOP/SIGCONT, kill -9 and restart of either
daemon as ``kvbm serve`` would restart it, the leader's counters summed over leader restarts
(``totals``), and the list of faults the wrapper injected (``injected_faults``).
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import grpc

from kvbm_client.local_node import Daemon as Process, LocalNode, isolated_env

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "tests" / "support" / "faults"


class Daemon(str, Enum):
    LEADER = "leader"
    WORKER = "worker"


@dataclass(frozen=True)
class NodeConfig:
    """Tier sizes, timeouts and faults of the node under test (``DYN_KVBM_*``, ``KVBM_FAULT_*``)."""

    g2_blocks: int = 48
    g3_blocks: int = 512
    job_timeout_s: float = 30.0
    no_nixl: bool = False
    #: the worker's staging area (``kvbm-worker --stage-mib``; 0: none, the worker's default)
    stage_mib: float = 0.0
    log_level: str = "info"
    #: the worker's test-only faults, ``(NAME, value)`` for ``KVBM_FAULT_<NAME>`` (tests/support/faults)
    faults: tuple[tuple[str, str], ...] = ()
    #: GPU engine (vLLM 0.26): the worker serves CUDA device ``gpu`` (``--gpu``) instead of ``--cpu``
    gpu: int | None = None
    #: the checkout whose daemons run (e.g. the code before a fix) [default: $KVBM_STRESS_SRC, else this one]
    src: str = os.environ.get("KVBM_STRESS_SRC", "")
    #: further node settings, ``(DYN_KVBM_NAME, value)`` (e.g. a policy knob under test)
    settings: tuple[tuple[str, str], ...] = ()

    def worker_args(self) -> list[str]:
        """The worker's command-line flags this configuration asks for."""
        return (["--no-nixl"] if self.no_nixl else []) + (
            ["--stage-mib", f"{self.stage_mib:g}"] if self.stage_mib else [])

    def env(self, root: Path) -> dict[str, str]:
        overrides: dict[str, object] = {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": self.g2_blocks, "DYN_KVBM_JOB_TIMEOUT_SECS": self.job_timeout_s,
            "DYN_LOG": self.log_level}
        if self.g3_blocks:
            overrides["DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"] = self.g3_blocks
        overrides.update(dict(self.settings))
        path = [str(FAULTS)] if self.faults else []
        path += [self.src or str(REPO), os.environ.get("PYTHONPATH", "")]
        overrides["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        if self.faults:
            overrides["KVBM_FAULT_LOG"] = root / "faults.log"
            overrides.update({f"KVBM_FAULT_{name}": value for name, value in self.faults})
        drop = [k for k in os.environ if k.startswith("KVBM_FAULT_")]
        return isolated_env(root, overrides, drop)


@dataclass
class StressNode:
    root: Path
    config: NodeConfig
    carried: dict = field(default_factory=dict)  # counters of leaders that were killed
    restarts: dict = field(default_factory=lambda: {Daemon.LEADER: 0, Daemon.WORKER: 0})

    def __post_init__(self) -> None:
        (self.root / "disk").mkdir(parents=True, exist_ok=True)
        gpus = None if self.config.gpu is None else [self.config.gpu]
        self.local = LocalNode(self.config.env(self.root), 1, gpus=gpus, log_dir=self.root,
                               worker_args=self.config.worker_args(),
                               cwd=Path(self.config.src) if self.config.src else REPO)

    @property
    def env(self) -> dict[str, str]:
        return self.local.env

    def process(self, what: Daemon) -> Process:
        return self.local.leader if what is Daemon.LEADER else self.local.workers[next(iter(self.local.workers))]

    # ------------------------------------------------------------------ processes
    def start_all(self, timeout: float = 60.0) -> "StressNode":
        self.local.start(timeout=timeout)
        return self

    def pid(self, what: Daemon) -> int:
        return self.process(what).pid

    def signal(self, what: Daemon, sig: int) -> None:
        self.process(what).send_signal(sig)

    def kill(self, what: Daemon) -> None:
        """kill -9, after saving a leader's counters (they die with it)."""
        if what is Daemon.LEADER:
            self._carry()
        self.local.kill(self.process(what), signal.SIGKILL)

    def restart(self, what: Daemon) -> None:
        """Start a killed daemon again, as ``kvbm serve`` would."""
        self.restarts[what] += 1
        if what is Daemon.LEADER:
            self.local.start_leader()
        else:
            self.local.start_worker("0")

    def close(self) -> None:
        for process in self.local.daemons:
            if process.running:
                process.send_signal(signal.SIGCONT)  # a stopped daemon cannot act on SIGTERM
        self.local.stop()

    # ------------------------------------------------------------------ status
    @property
    def worker_socket(self) -> str:
        return self.local.worker_address("0")

    def status(self, timeout: float = 5.0):
        return self.local.status(timeout)

    def worker_status(self, timeout: float = 5.0):
        return self.local.worker_status("0", timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        self.local.wait_ready(timeout)

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
