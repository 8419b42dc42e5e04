"""One node's daemons (a leader and its workers) as child processes of this process.

Runs in whatever starts a node on this machine: ``kvbm serve`` (:class:`kvbm_client.cli.Supervisor`
adds its restart policy on top), the test fixtures and the benchmarks. A :class:`LocalNode` owns
the processes it started and their log files, and nothing else: it signals only those, by pid.

Invariants:
* The leader is started before the workers and stopped after them (a worker removes its disk
  file and detaches on SIGTERM while its leader still answers).
* A stop is SIGTERM, then SIGKILL after a timeout; every process started is reaped.
* Daemons are started by module name (``python -m kvbm_leader`` / ``-m kvbm_worker``): this
  package never imports them.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

import grpc

from .config import KvbmConfig
from .channels import open_channel
from .contract import pb, rpc
from .errors import KvbmTimeoutError, KvbmUnavailableError
from .ids import WorkerId

log = logging.getLogger("kvbm.local_node")

LEADER_MODULE = "kvbm_leader"
WORKER_MODULE = "kvbm_worker"
#: Seconds to wait for the workers to attach (a GPU worker imports torch first: pass more).
READY_TIMEOUT = 30.0
#: Seconds a daemon gets between SIGTERM and SIGKILL.
STOP_TIMEOUT = 15.0
_POLL_S = 0.05
_LOG_TAIL = 1500
_PR_SET_PDEATHSIG = 1
_Node = TypeVar("_Node", bound="LocalNode")


def leader_status(address: str, timeout: float = 2.0, config: KvbmConfig | None = None) -> pb.StatusResponse:
    """The leader's ``Status`` at ``address`` (raises ``grpc.RpcError`` when it does not answer)."""
    with open_channel(address, config or KvbmConfig.from_env()) as channel:
        response: pb.StatusResponse = rpc.LeaderStub(channel).Status(pb.StatusRequest(), timeout=timeout)
        return response


def worker_status(address: str, timeout: float = 2.0,
                  config: KvbmConfig | None = None) -> pb.WorkerStatusResponse:
    """A worker's own ``Status`` at ``address`` (raises ``grpc.RpcError`` when it does not answer)."""
    with open_channel(address, config or KvbmConfig.from_env()) as channel:
        response: pb.WorkerStatusResponse = rpc.WorkerStub(channel).Status(pb.WorkerStatusRequest(),
                                                                            timeout=timeout)
        return response


def isolated_env(root: Path, overrides: Mapping[str, object] | None = None, drop: Sequence[str] = (),
                 base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a node that shares nothing with another: ``base`` (this process's
    environment) minus every ``DYN_KVBM_*`` and the names in ``drop``, with the socket and disk
    directories under ``root``, then ``overrides``; an override of "" unsets a variable."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("DYN_KVBM_") and k not in drop}
    env.update(DYN_KVBM_SOCKET_DIR=str(root / "sock"), DYN_KVBM_DISK_CACHE_DIR=str(root / "disk"),
               PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in (overrides or {}).items()})
    return {k: v for k, v in env.items() if v != ""}


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Daemon:
    """One daemon child process (the leader or a worker): what it runs and where it logs.

    Quacks like the ``subprocess.Popen`` of its latest start (``pid``, ``poll``, ``wait``,
    ``send_signal``), so callers can signal it as they would a process.
    """

    name: str
    argv: list[str]
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def _started(self) -> subprocess.Popen[bytes]:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc

    @property
    def pid(self) -> int:
        return self._started().pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exited(self) -> bool:
        """Started, and has exited since (a daemon never started has not exited)."""
        return self.proc is not None and self.proc.poll() is not None

    def poll(self) -> int | None:
        return self._started().poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._started().wait(timeout)

    def send_signal(self, sig: int) -> None:
        self._started().send_signal(sig)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM, and SIGKILL if it has not exited within ``timeout``; returns its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.reap(time.monotonic() + timeout)

    def reap(self, deadline: float) -> int:
        """Wait for the exit until ``deadline`` (monotonic), then SIGKILL; returns the exit code."""
        proc = self._started()
        try:
            return proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("kvbm: %s did not stop in time; killing it", self.name)
            proc.kill()
            return proc.wait()

    def log_tail(self, chars: int = _LOG_TAIL) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]


class LocalNode:
    """A leader and ``num_workers`` workers of one node, as child processes.

    Args:
        env: the daemons' whole environment (``DYN_KVBM_*`` settings included); see
            :func:`isolated_env` for a node of its own.
        num_workers: CPU workers ``0..num_workers-1`` (``--cpu``), unless ``gpus`` is given.
        gpus: CUDA devices, one worker each: worker ``i`` serves ``gpus[i]`` (``--gpu``).
        log_dir: each daemon appends its stdout and stderr to ``<log_dir>/<leader|worker-ID>.log``;
            None: they inherit this process's.
        leader_args / worker_args: extra flags of every leader / worker start.
        detach: each daemon in its own session (a terminal's Ctrl-C reaches only this process,
            which stops them in order) and SIGTERMed by the kernel if this process dies.
            NOTE: uses ``preexec_fn``, which is unsafe in a process with threads: for
            ``kvbm serve`` only.
        own_session: each daemon in its own session, without the rest of ``detach`` (no
            ``preexec_fn``: safe with threads). With the kernel's autogroup scheduling a session
            is also a CPU share: daemons in the session of busy work (a test run) can wait
            seconds for a CPU (README, "Starved, not stalled").
        python: the interpreter that runs ``-m kvbm_leader`` / ``-m kvbm_worker``.
        cwd: the daemons' working directory [default: this process's].
    """

    def __init__(self, env: Mapping[str, str], num_workers: int = 1, *, gpus: Sequence[int] | None = None,
                 log_dir: Path | None = None, leader_args: Sequence[str] = (), worker_args: Sequence[str] = (),
                 detach: bool = False, own_session: bool = False, python: str = sys.executable,
                 cwd: Path | None = None) -> None:
        self.env = dict(env)
        self.log_dir = log_dir
        self.detach = detach
        self.own_session = own_session or detach
        self.python = python
        self.cwd = cwd
        self.leader_args = list(leader_args)
        self.worker_args = list(worker_args)
        devices: list[int | None] = list(gpus) if gpus else [None] * num_workers
        #: The planned workers and the CUDA device of each (None: a CPU worker).
        self.devices: dict[WorkerId, int | None] = {WorkerId(str(i)): d for i, d in enumerate(devices)}
        self.leader = self._leader_daemon(())
        self.workers: dict[WorkerId, Daemon] = {w: self._worker_daemon(w, ()) for w in self.devices}

    # ------------------------------------------------------------------ where things are
    def config(self) -> KvbmConfig:
        """The node's settings, as its daemons and clients read them from ``env``."""
        return KvbmConfig.from_env(self.env)

    @property
    def leader_address(self) -> str:
        return self.config().resolved_leader_address

    def worker_address(self, worker_id: str) -> str:
        return self.config().worker_address(worker_id)

    @property
    def daemons(self) -> list[Daemon]:
        """Leader first, then the workers in id order of first start."""
        return [self.leader, *self.workers.values()]

    # ------------------------------------------------------------------ start
    def _daemon(self, name: str, module: str, args: Sequence[str]) -> Daemon:
        log_path = self.log_dir / f"{name.replace(' ', '-')}.log" if self.log_dir is not None else None
        return Daemon(name, [self.python, "-m", module, *args], log_path)

    def _leader_daemon(self, extra: Sequence[str]) -> Daemon:
        args = ["--num-workers", str(len(self.devices)), *self.leader_args, *extra]
        return self._daemon("leader", LEADER_MODULE, args)

    def _worker_daemon(self, worker_id: WorkerId, extra: Sequence[str]) -> Daemon:
        """Worker ``worker_id``: a planned one, or an extra CPU worker on a CPU node."""
        device = self.devices.get(worker_id)
        assert device is not None or all(d is None for d in self.devices.values()), \
            f"no GPU is planned for worker {worker_id}"
        medium = ["--cpu"] if device is None else ["--gpu", str(device)]
        return self._daemon(f"worker {worker_id}", WORKER_MODULE,
                            ["--worker-id", worker_id, *medium, *self.worker_args, *extra])

    def spawn(self, daemon: Daemon) -> Daemon:
        """Start ``daemon`` (again, if it ran before and has exited)."""
        assert not daemon.running, f"{daemon.name} is already running (pid {daemon.pid})"
        out: IO[bytes] | None = None
        if daemon.log_path is not None:
            daemon.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(daemon.log_path, "ab")
        try:
            daemon.proc = subprocess.Popen(
                daemon.argv, env=self.env, cwd=self.cwd, stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                preexec_fn=_die_with_parent if self.detach else None, start_new_session=self.own_session)
        finally:
            if out is not None:
                out.close()  # the child holds its own descriptor
        return daemon

    def start(self: _Node, wait: bool = True, timeout: float = READY_TIMEOUT) -> _Node:
        """Start the leader, then every planned worker; with ``wait``, until all have attached."""
        self.start_leader()
        for worker_id in self.devices:
            self.start_worker(worker_id)
        if wait:
            self.wait_attached(timeout=timeout)
        return self

    def start_leader(self, *extra: str) -> Daemon:
        """Start a leader (the previous one must have exited), with ``extra`` flags this time."""
        self.leader = self.spawn(self._leader_daemon(extra))
        return self.leader

    def start_worker(self, worker_id: str, *extra: str) -> Daemon:
        """Start worker ``worker_id`` (the previous one must have exited), ``extra`` flags this time."""
        wid = WorkerId(worker_id)
        previous = self.workers.get(wid)
        assert previous is None or not previous.running, f"worker {worker_id} is already running"
        self.workers[wid] = self.spawn(self._worker_daemon(wid, extra))
        return self.workers[wid]

    # ------------------------------------------------------------------ signals and stop
    def kill(self, daemon: Daemon, sig: int = signal.SIGKILL, timeout: float = STOP_TIMEOUT) -> int:
        """Send ``sig`` (one that ends it) to ``daemon`` and wait for the exit; returns its exit code."""
        daemon.send_signal(sig)
        return daemon.wait(timeout)

    def signal_worker(self, worker_id: str, sig: int, timeout: float = STOP_TIMEOUT) -> int:
        return self.kill(self.workers[WorkerId(worker_id)], sig, timeout)

    def restart(self, daemon: Daemon, timeout: float = STOP_TIMEOUT) -> Daemon:
        """Stop ``daemon`` (SIGTERM, then SIGKILL) and start it again with the same command."""
        daemon.stop(timeout)
        return self.spawn(daemon)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop every daemon: the workers together, then the leader. Idempotent."""
        for group in (list(self.workers.values()), [self.leader]):
            for daemon in group:
                if daemon.running:
                    daemon.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for daemon in group:
                if daemon.proc is not None:
                    daemon.reap(deadline)

    def __enter__(self: _Node) -> _Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ readiness
    def status(self, timeout: float = 2.0) -> pb.StatusResponse:
        return leader_status(self.leader_address, timeout)

    def worker_status(self, worker_id: str = "0", timeout: float = 5.0) -> pb.WorkerStatusResponse:
        return worker_status(self.worker_address(worker_id), timeout)

    def wait_attached(self, n: int | None = None, timeout: float = READY_TIMEOUT) -> pb.StatusResponse:
        """Until ``n`` workers (default: every planned one) have attached to the leader."""
        want = len(self.devices) if n is None else n
        return self._wait(lambda s: len(s.workers) >= want, f"{want} workers attached", want, timeout)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> pb.StatusResponse:
        """Until the leader reports state "ready" (every worker attached and its pools allocated)."""
        return self._wait(lambda s: s.state == "ready", "node ready", 0, timeout)

    def _wait(self, done: Callable[[pb.StatusResponse], bool], what: str, workers: int,
              timeout: float) -> pb.StatusResponse:
        """Poll the leader's Status until ``done``; fail at once when the leader, or so many
        workers that fewer than ``workers`` run, has exited."""
        end = time.monotonic() + timeout
        while True:
            self._check_running(what, workers)
            try:
                status = self.status(min(2.0, max(0.1, end - time.monotonic())))
                if done(status):
                    return status
            except grpc.RpcError:
                pass
            if time.monotonic() > end:
                raise KvbmTimeoutError(f"{what}: not within {timeout:g}s\n{self.log_tails()}")
            time.sleep(_POLL_S)

    def _check_running(self, what: str, workers: int) -> None:
        if self.leader.exited:
            raise KvbmUnavailableError(f"{what}: the leader exited with {self.leader.returncode}\n"
                                       f"{self.log_tails()}")
        running = sum(w.running for w in self.workers.values())
        if running < workers:
            dead = ", ".join(f"{w.name} ({w.returncode})" for w in self.workers.values() if w.exited)
            raise KvbmUnavailableError(f"{what}: only {running} workers run; exited: {dead}\n{self.log_tails()}")

    def log_tails(self, chars: int = _LOG_TAIL) -> str:
        """The end of every daemon's log, for an error message."""
        if self.log_dir is None:
            return "(the daemons log to this process's output)"
        return "\n".join(f"--- {d.log_path}\n{d.log_tail(chars)}" for d in self.daemons)
