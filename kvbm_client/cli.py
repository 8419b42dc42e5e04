"""``kvbm``: the operator's command. ``kvbm serve`` runs a node (leader + workers as child
processes, restarted if they crash); ``kvbm status`` shows pools, hit rates and workers.

The daemons are started by module name (``python -m kvbm_leader`` / ``kvbm_worker``): this
package never imports them.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc

from .config import KvbmConfig, add_config_arguments, config_from_args, config_to_env
from .channels import open_channel
from .contract import pb, rpc
from .errors import KvbmConfigError
from .ids import Tier

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0


class Supervisor:
    """Starts the node's daemons and restarts any that dies (backoff up to 5 s)."""

    def __init__(self, config: KvbmConfig, num_workers: int, extra_env: dict[str, str], debug: bool,
                 gpus: list[int] | None = None) -> None:
        self.config = config
        self.env = {**os.environ, **config_to_env(config), **extra_env}
        if debug:
            self.env["DYN_LOG"] = "debug"
        py = sys.executable
        # One worker per GPU (worker i serves device gpus[i], rank i), or CPU workers.
        media = [["--gpu", str(d)] for d in gpus] if gpus else [["--cpu"]] * num_workers
        self.leader = Child("leader", [py, "-m", "kvbm_leader", "--num-workers", str(len(media))])
        self.workers = [Child(f"worker {i}", [py, "-m", "kvbm_worker", "--worker-id", str(i), *medium])
                        for i, medium in enumerate(media)]
        self.stopping = False

    @property
    def children(self) -> list[Child]:
        return [self.leader, *self.workers]

    def spawn(self, child: Child) -> None:
        # Own process group: a terminal's Ctrl-C reaches only the supervisor, which then stops
        # the daemons in order; PDEATHSIG still takes them down if the supervisor is killed.
        child.proc = subprocess.Popen(child.argv, env=self.env, preexec_fn=_die_with_parent,
                                      start_new_session=True)

    def poll(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None and not self.stopping:
                code = child.proc.returncode
                child.restarts += 1
                delay = min(5.0, 0.2 * 2 ** min(child.restarts, 5))
                print(f"kvbm: {child.name} exited with {code}; restarting in {delay:.1f}s", file=sys.stderr,
                      flush=True)
                child.proc, child.next_start = None, now + delay
            if child.proc is None and not self.stopping and now >= child.next_start:
                self.spawn(child)

    def stop(self, timeout: float = 15.0) -> None:
        """Workers first (they remove their disk files), then the leader."""
        self.stopping = True
        for group in (self.workers, [self.leader]):
            for child in group:
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + timeout
            for child in group:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"kvbm: {child.name} did not stop in {timeout:g}s; killing it", file=sys.stderr)
                    child.proc.kill()
                    child.proc.wait()


def _status(address: str, timeout: float = 5.0, config: KvbmConfig | None = None) -> "pb.StatusResponse":
    with open_channel(address, config or KvbmConfig.from_env()) as channel:
        return rpc.LeaderStub(channel).Status(pb.StatusRequest(), timeout=timeout)


def _alloc_progress(worker: "pb.WorkerInfo") -> float:
    """A worker that is allocating knows its progress before the leader does: ask it."""
    try:
        with open_channel(worker.endpoint, KvbmConfig.from_env()) as channel:
            return rpc.WorkerStub(channel).Status(pb.WorkerStatusRequest(), timeout=1.0).info.alloc_progress
    except grpc.RpcError:
        return worker.alloc_progress


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        config.require_tier()
    except KvbmConfigError as exc:
        print(f"kvbm serve: {exc}", file=sys.stderr)
        return 2
    try:
        gpus = [int(d) for d in args.gpus.split(",")] if args.gpus else None
    except ValueError:
        print(f"kvbm serve: --gpus wants comma-separated device ordinals, got {args.gpus!r}", file=sys.stderr)
        return 2
    sup = Supervisor(config, args.workers, {}, args.debug, gpus)
    expected_workers = len(sup.workers)
    stop = {"signal": None}

    def on_signal(signum, _frame) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    address = config.resolved_leader_address
    announced = False
    started = time.monotonic()
    try:
        sup.spawn(sup.leader)
        for worker in sup.workers:
            sup.spawn(worker)
        while stop["signal"] is None:
            sup.poll()
            if not announced:
                try:
                    status = _status(address, 1.0, config)
                    if len(status.workers) == expected_workers:
                        announced = True
                        metrics = (f"http://{config.metrics_addr}:{config.metrics_port}/metrics"
                                   if config.metrics else "off (DYN_KVBM_METRICS=true to enable)")
                        print(f"kvbm serving: leader {address}\n  workers: "
                              + ", ".join(f"{w.worker_id}={w.endpoint}" for w in status.workers)
                              + f"\n  metrics: {metrics}\n  disk dir: {config.disk_cache_dir}"
                              "\n  stop with Ctrl-C (SIGINT) or SIGTERM", flush=True)
                except grpc.RpcError:
                    if time.monotonic() - started > config.leader_worker_init_timeout_secs:
                        print("kvbm serve: the node did not come up within the init timeout", file=sys.stderr)
                        return 3
            time.sleep(0.1)
    finally:
        sup.stop()
    print("kvbm: stopped", flush=True)
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def cmd_status(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    address = args.leader or config.resolved_leader_address
    try:
        status = _status(address, config=config)
    except KvbmConfigError as exc:
        print(f"kvbm status: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"kvbm status: leader at {address} unreachable ({exc.code().name}: {exc.details()})",
              file=sys.stderr)
        return 1
    if args.json:
        from google.protobuf.json_format import MessageToDict
        print(json.dumps(MessageToDict(status), indent=2))
        return 0
    print(f"leader {status.leader_id}: {status.state}, {status.sessions} sessions, {status.pending_jobs} jobs in flight")
    for t in status.tiers:
        tier = Tier(t.tier)
        print(f"  {tier.label} {tier.name.lower():5s} {t.used_blocks}/{t.capacity_blocks} blocks used, "
              f"{t.pinned_blocks} pinned, hit rate {t.hit_rate:.2f}")
    for w in status.workers:
        lay = w.layout
        shape = f"{lay.num_layers} layers x {lay.page_bytes} B, {lay.num_engine_blocks} engine blocks" \
            if w.HasField("layout") else "no engine yet"
        alloc = f" ({_alloc_progress(w) * 100:.0f}% allocated)" if w.state == "allocating" else ""
        print(f"  worker {w.worker_id} rank {w.rank}: {w.state}{alloc}; {shape}; "
              f"G2 {_fmt_bytes(w.host_bytes)}, G3 {_fmt_bytes(w.disk_bytes)}; {w.endpoint}")
    c = status.counters
    print("  offload d2h {:.0f}, h2d {:.0f}, d2d {:.0f}; onboard h2d {:.0f}, d2d {:.0f}; matched tokens {:.0f}".format(
        c.get("kvbm_offload_blocks_d2h", 0), c.get("kvbm_offload_blocks_h2d", 0), c.get("kvbm_offload_blocks_d2d", 0),
        c.get("kvbm_onboard_blocks_h2d", 0), c.get("kvbm_onboard_blocks_d2d", 0), c.get("kvbm_matched_tokens", 0)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbm", description="kvbm: a multi-tier KV-cache block manager "
                                     "(G1 GPU -> G2 host memory -> G3 disk) for LLM serving engines.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run this node's leader and workers until SIGINT/SIGTERM",
                           description="Start the leader and N workers of this node as child processes "
                                       "(restarted if they crash), print where they listen, stop cleanly on "
                                       "SIGINT/SIGTERM. Needs neither etcd nor NATS.")
    serve.add_argument("--workers", type=int, default=1,
                       help="CPU worker daemons to start, for CPU engines whose KV cache is in shared "
                            "memory [default 1]")
    serve.add_argument("--gpus", default=None, metavar="0,1,...",
                       help="CUDA devices, one worker daemon each (rank = position in the list); "
                            "replaces --workers")
    serve.add_argument("--debug", action="store_true", help="DYN_LOG=debug for the daemons")
    add_config_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    status = sub.add_parser("status", help="print pools, hit rates and workers of the local node")
    status.add_argument("--leader", default=None, help="leader address [default: the local socket]")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    add_config_arguments(status, fields=("socket_dir", "leader_address"))
    status.set_defaults(func=cmd_status)
    from .doctor.cli import add_doctor_parser  # kvbm doctor: its own package
    add_doctor_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
