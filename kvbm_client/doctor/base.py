"""What every ``kvbm doctor`` check shares: the result type, the options and the run context.

Runs in the ``kvbm doctor`` process, on the node to be checked (never inside a daemon).
A check is a small function ``check(ctx) -> CheckResult``; it may probe the machine (files,
sockets, devices) but never changes what a node would use, and removes what it created.
Only :attr:`Status.FAIL` makes the command exit 1; a warning is advice.
"""
from __future__ import annotations

import enum
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import grpc

from ..config import KvbmConfig
from ..contract import GRPC_OPTIONS, pb, rpc
from ..endpoints import is_unix, unix_path
from ..errors import KvbmConfigError


class Status(enum.Enum):
    """How one check came out; only FAIL fails the command."""

    OK = "ok"
    INFO = "info"  # a fact worth showing, neither good nor bad (e.g. "not running")
    WARN = "warn"  # works, but an operator should know (slow path, little headroom)
    FAIL = "fail"  # the node would not start or would misbehave
    SKIP = "skip"  # not applicable here (no CUDA, etcd not configured, ...)


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome: ``message`` says what was found, ``remedy`` what to do about it."""

    status: Status
    message: str
    remedy: str = ""
    data: dict[str, Any] = field(default_factory=dict)  # figures for --json (bytes, GB/s, ...)


def ok(message: str, **data: Any) -> CheckResult:
    return CheckResult(Status.OK, message, "", data)


def info(message: str, remedy: str = "", **data: Any) -> CheckResult:
    return CheckResult(Status.INFO, message, remedy, data)


def warn(message: str, remedy: str, **data: Any) -> CheckResult:
    return CheckResult(Status.WARN, message, remedy, data)


def fail(message: str, remedy: str, **data: Any) -> CheckResult:
    return CheckResult(Status.FAIL, message, remedy, data)


def skip(message: str, **data: Any) -> CheckResult:
    return CheckResult(Status.SKIP, message, "", data)


@dataclass(frozen=True)
class LayoutArg:
    """``--layout LAYERS:PAGE_BYTES[:WORKERS]``: one block's shard on each of WORKERS workers."""

    num_layers: int
    page_bytes: int
    workers: int | None = None  # None: the node's worker count (--gpus / --workers)

    @classmethod
    def parse(cls, text: str) -> "LayoutArg":
        parts = text.split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) not in (2, 3) or min(values) <= 0:
            raise ValueError(f"--layout wants LAYERS:PAGE_BYTES[:WORKERS] (positive integers), got {text!r}")
        return cls(values[0], values[1], values[2] if len(values) == 3 else None)


@dataclass(frozen=True)
class DoctorOptions:
    """What the operator asked for on the command line (beyond the node's configuration)."""

    workers: int = 1
    gpus: tuple[int, ...] = ()
    layout: LayoutArg | None = None
    bench_disk: bool = False
    bench_h2d: bool = False
    stage_bytes: int = 0  # each worker's staging area (--stage-mib), 0: none
    timeout_s: float = 1.5  # per network probe (etcd, NATS, leader, each worker)
    shm_dir: str = "/dev/shm"  # NOTE: the vLLM connector's CPU KV cache always lives there

    @property
    def num_workers(self) -> int:
        return len(self.gpus) if self.gpus else self.workers


@dataclass
class NodeProbe:
    """The running node as its leader (and each worker) answered, or why it did not."""

    address: str
    status: "pb.StatusResponse | None" = None
    error: str = ""
    code: grpc.StatusCode | None = None
    workers: dict[str, "pb.WorkerStatusResponse | str"] = field(default_factory=dict)  # id -> answer | error
    listening: bool = False  # something accepts connections at ``address`` (set when Status failed)

    @property
    def running(self) -> bool:
        return self.status is not None


def accepts_connections(address: str, timeout_s: float) -> bool:
    """Whether a process listens at a gRPC ``address`` (``unix:/path`` or ``host:port``).

    NOTE: a stopped or wedged leader still has its socket accepted by the kernel, while gRPC
    reports UNAVAILABLE exactly as for no leader at all; this tells the two apart.
    """
    target: str | tuple[str, int]
    try:
        if is_unix(address):
            family, target = socket.AF_UNIX, unix_path(address)
        else:
            host, _, port = address.rpartition(":")
            family, target = socket.AF_INET6 if ":" in host else socket.AF_INET, (host.strip("[]"), int(port))
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(target)
            return True
    except (OSError, ValueError):
        return False


def probe_node(address: str, timeout_s: float) -> NodeProbe:
    """Ask the leader at ``address`` for its Status, then every worker it lists for theirs."""
    probe = NodeProbe(address)
    try:
        with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
            probe.status = rpc.LeaderStub(channel).Status(pb.StatusRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        probe.code, probe.error = exc.code(), f"{exc.code().name}: {exc.details()}"
        probe.listening = accepts_connections(address, timeout_s)
        return probe
    for worker in probe.status.workers:
        try:
            with grpc.insecure_channel(worker.endpoint, options=GRPC_OPTIONS) as channel:
                probe.workers[worker.worker_id] = rpc.WorkerStub(channel).Status(
                    pb.WorkerStatusRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            probe.workers[worker.worker_id] = f"{exc.code().name}: {exc.details()}"
    return probe


@dataclass
class DoctorContext:
    """Everything one ``kvbm doctor`` run knows: the parsed configuration (or why it did not
    parse), the options, and the running node, asked once and shared by the checks."""

    config: KvbmConfig | None
    config_error: str = ""
    options: DoctorOptions = field(default_factory=DoctorOptions)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    _node: NodeProbe | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], options: DoctorOptions | None = None) -> "DoctorContext":
        """Parse ``env`` like the daemons do; a configuration error is recorded, not raised."""
        options = options or DoctorOptions()
        try:
            return cls(KvbmConfig.from_env(env), options=options, env=dict(env))
        except KvbmConfigError as exc:
            return cls(None, str(exc), options, dict(env))

    @property
    def cfg(self) -> KvbmConfig:
        """The parsed configuration; the runner calls checks that need it only when there is one."""
        assert self.config is not None, "a check that needs the configuration ran without one"
        return self.config

    def node(self) -> NodeProbe:
        """The running node, probed on first use (needs a configuration that parsed)."""
        if self._node is None:
            self._node = probe_node(self.cfg.resolved_leader_address, self.options.timeout_s)
        return self._node


#: The signature of every check.
CheckFn = Callable[[DoctorContext], CheckResult]


@dataclass(frozen=True)
class Check:
    """One registered check: ``group.name`` in the report, whether it needs the configuration,
    and the :class:`DoctorOptions` flag that turns it on (None: always runs)."""

    group: str
    name: str
    fn: CheckFn
    needs_config: bool = True
    option: str | None = None

    @property
    def id(self) -> str:
        return f"{self.group}.{self.name}"
