"""The worker daemon (``kvbm-worker``, one per GPU): its command line, its gRPC server, and
the order in which its parts start and stop.

Runs as its own process on a uvloop event loop. Parts, each the one owner of its concern:

* :class:`~.service.WorkerService`: region, pools, lanes, jobs; the ``Worker`` gRPC servicer;
* :class:`~.leader_link.LeaderLink`: attach stream, layout, pool plans, job go/reports;
* :class:`~.cluster.WorkerCluster`: etcd registration and leader discovery, NATS commands.

Lifecycle (ordered, idempotent): ``start()`` reads the node key (the leader creates it),
opens the CUDA context (``--gpu``), serves, joins the cluster plane, then attaches;
``close()`` detaches, leaves the cluster plane, stops serving, then closes the service
(copies drained, pools and G3 files freed, region unmapped).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

import grpc

from kvbm_client.config import KvbmConfig, add_config_arguments, config_from_args
from kvbm_client.contract import rpc
from kvbm_client.endpoints import remove_unix_socket
from kvbm_client.errors import KvbmConfigError
from kvbm_client.heap import freeze_startup_heap, log_slow_collections
from kvbm_client.ids import WorkerId
from kvbm_client.logs import log_loop_stalls, setup_logging
from kvbm_client.security import wait_node_key
from kvbm_client.serving import make_server, start_server
from kvbm_client.sizing import stage_bytes

from .allocation import DataPath
from .cluster import WorkerCluster
from .grouping import GROUP_DEPTH, PIECE_BYTES, GroupPacing, GroupShape
from .handlers.cuda_copier import CopyMechanism
from .handlers.issuers import ISSUE_THREADS, MAX_ISSUE_THREADS, MAX_SPLIT_MIN_COPIES, SPLIT_MIN_COPIES
from .leader_link import LeaderLink
from .loads_first import MAX_STORE_YIELD_MS, STORE_YIELD_MS
from .service import WorkerService
from .stages import STAGE_HOLD_S

log = logging.getLogger("kvbm.worker")


class WorkerDaemon:
    """One per GPU (or ``--cpu``); see the module docstring."""

    def __init__(self, config: KvbmConfig, worker_id: str, rank: int, address: str | None = None,
                 leader_address: str | None = None, path: DataPath = DataPath()) -> None:
        self.config = config
        self.worker_id = WorkerId(worker_id)
        self.rank = rank
        self.address = address or config.worker_address(worker_id)
        self.leader_address = leader_address or config.resolved_leader_address
        self.path = path
        # the leader is found through etcd unless given explicitly
        self._discover = leader_address is None and config.leader_address is None
        self.service: WorkerService | None = None
        self.link: LeaderLink | None = None
        self.cluster: WorkerCluster | None = None
        self._server: grpc.aio.Server | None = None
        self._stall_task: asyncio.Task[None] | None = None
        self._started = self._closed = False

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("WorkerDaemon.start() called twice")
        self._started = True
        cfg = self.config
        node_key = await wait_node_key(cfg.resolved_node_key_file, cfg.leader_worker_init_timeout_secs)
        if self.path.gpu is not None:  # CUDA context before serving, off the loop; lazy import (CPU CI)
            from .handlers.cuda import init_device
            name = await asyncio.get_running_loop().run_in_executor(None, init_device, self.path.gpu)
            log.info("GPU data path on cuda:%d (%s), copy mechanism %s", self.path.gpu, name,
                     self.path.cuda_copy.value)
        self.link = link = LeaderLink(cfg, self.worker_id, self.rank, self.address, node_key, self.leader_address,
                                      cuda=self.path.gpu is not None, find_leader=self._find_leader)
        self.service = service = WorkerService(cfg, self.worker_id, self.rank, link, node_key, self.path)
        self.cluster = WorkerCluster(cfg, self.worker_id, self.rank, self.address, self._discover,
                                     service.runner.acknowledge)
        self._server = make_server(cfg, self.address, node_key)
        rpc.add_WorkerServicer_to_server(service, self._server)
        await start_server(self._server, self.address, cfg)
        await service.start()  # the region socket, beside the gRPC socket
        await self.cluster.start()
        await link.start(service)
        if log.isEnabledFor(logging.DEBUG):  # DYN_LOG=debug: say when the loop could not answer
            self._stall_task = asyncio.ensure_future(log_loop_stalls(log))
        log.info("worker %s (rank %d) listening on %s; leader %s", self.worker_id, self.rank, self.address,
                 self.leader_address)

    async def _find_leader(self) -> str | None:
        assert self.cluster is not None
        return await self.cluster.leader_address(self.config.leader_worker_init_timeout_secs)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.service is not None:
            self.service.runner.closing = True  # refuse new work while the rest goes down
        if self._stall_task is not None:
            self._stall_task.cancel()
        if self.link is not None:
            await self.link.close()
        if self.cluster is not None:
            await self.cluster.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self.service is not None:
            await self.service.close()
        remove_unix_socket(self.address)
        log.info("worker %s stopped", self.worker_id)


async def run(daemon: WorkerDaemon) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # NOTE: start() may wait long (for the leader's node key, for the leader): a SIGTERM
    # meanwhile stops the daemon instead of waiting for those timeouts.
    starting = asyncio.ensure_future(daemon.start())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            try:
                starting.result()  # a failed start raises here
            except KvbmConfigError as exc:  # e.g. a socket path too long to bind (as the leader's run)
                log.error("%s", exc)
                return 2
            freeze_startup_heap("worker")
            if log.isEnabledFor(logging.DEBUG):
                log_slow_collections("worker")  # (a collection stops the copy lane's thread too)
            await stopping
        else:
            log.info("stopped while starting")
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
    finally:
        stopping.cancel()
        await daemon.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


#: NOTE: Python's default switch interval is 5 ms. Beside vLLM on an H100 (2026-11-26) the load
#: lane spent 40-70 ms issuing a 3 GB load's copies (0.35 ms a 256 MiB piece outside the daemon):
#: at 0.5 ms a 256 MiB piece took 4.35 ms instead of 6.05 and the load 60.8 ms instead of 74.8
#: (one run each, consecutive; README "Results ... fifth session").
SWITCH_INTERVAL_MS = 0.5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbm-worker",
        description="kvbm worker daemon (one per GPU): owns the G2 host pool and G3 disk file of its GPU, "
                    "maps the engine's KV memory and moves blocks on the leader's signed plans.")
    parser.add_argument("--worker-id", default="0", help="this worker's id, as the leader expects it [default 0]")
    parser.add_argument("--rank", type=int, default=None, help="engine rank (TP rank) [default: the worker id]")
    parser.add_argument("--listen", default=None,
                        help="gRPC address: unix:/path or host:port [default <socket dir>/worker-ID.sock]")
    parser.add_argument("--insecure", action="store_true",
                        help="allow --listen on TCP without TLS and client authentication (test setups only; "
                             "logged as a warning) [env DYN_KVBM_INSECURE_TCP]")
    parser.add_argument("--leader", default=None, help="leader address [default DYN_KVBM_LEADER_ADDRESS or "
                                                       "<socket dir>/leader.sock]")
    medium = parser.add_mutually_exclusive_group()
    medium.add_argument("--cpu", action="store_true",
                        help="CPU data path (the default): the engine's KV cache is host shared memory; CUDA is "
                             "never imported and CUDA IPC regions are refused")
    medium.add_argument("--gpu", type=int, default=None, metavar="DEVICE",
                        help="GPU data path on CUDA device DEVICE: open the KV cache through CUDA IPC, pin G2, "
                             "copy on CUDA streams (needs torch with CUDA and cuda-python)")
    parser.add_argument("--cuda-copy", default=CopyMechanism.AUTO.value, choices=[m.value for m in CopyMechanism],
                        help="G1<->G2 copy mechanism with --gpu [default auto: direct, i.e. cudaMemcpyBatchAsync "
                             "called through ctypes on torch's CUDA runtime (loads hold the interpreter lock, "
                             "stores give it up), once a "
                             "check copy at start moved the right bytes; else batch (the same API through "
                             "cuda-python) where the CUDA runtime has it (>= 12.8); else one DMA per contiguous run "
                             "when runs average >= 256 KiB, else a GPU gather into staging + DMA]")
    parser.add_argument("--no-nixl", action="store_true", help="use preadv/pwritev for disk I/O instead of NIXL")
    parser.add_argument("--load-group-shape", default=GroupShape.FRONT.value, choices=[s.value for s in GroupShape],
                        help="how a layer-grouped load's pages are split into the groups the engine asks for: front "
                             "(shrinking groups, the last about a layer: after it lands the engine has only that "
                             "layer left to run) or even (equal groups) [default front]")
    parser.add_argument("--load-piece-mb", type=float, default=PIECE_BYTES / (1 << 20), metavar="MIB",
                        help="a layer-grouped load (the connector's layerwise mode) is copied in pieces of at most "
                             "this many MiB of one layer group's pages; the engine hears of a group once its last "
                             f"piece landed [default {PIECE_BYTES >> 20}]")
    parser.add_argument("--load-ahead", type=int, default=GROUP_DEPTH, metavar="N",
                        help="pieces of a layer-grouped load queued on the copy stream behind the one the copy "
                             "lane waits for; 0: all of them (a piece is queued only if it would land before the "
                             f"job's deadline at 1 GB/s) [default {GROUP_DEPTH}]")
    parser.add_argument("--stage-mib", type=float, default=0, metavar="MIB",
                        help="a staging area of this many MiB (on the GPU with --gpu: memory outside the engine's "
                             "budget) for loads staged at their lookup, before the engine allocated their blocks "
                             "(the connector's staged_loads, on by default, uses it once this worker reports it): "
                             "the first layer group of every block is copied into it while the leader's go is "
                             "asked, and scattered into the blocks once they are known (the other groups are "
                             "copied straight, so a larger area gains nothing); one staged load at a time, "
                             f"held {STAGE_HOLD_S:g} s for its blocks. 20K tokens of a Qwen3-4B-sized model: 1024 "
                             "holds the first group of six. 0: no staging area (stages are refused) [default 0]")
    parser.add_argument("--issue-threads", type=int, default=ISSUE_THREADS, metavar="N",
                        help="with --gpu: threads issuing a load's copies at once when one call has at least "
                             f"{SPLIT_MIN_COPIES} (a KV cache allocated per layer, as vLLM's V2 model runner does, "
                             "gives a copy per block and layer; one cross-layer buffer a copy per block); 1: the "
                             f"copy lane alone [default {ISSUE_THREADS}]")
    parser.add_argument("--issue-split-copies", type=int, default=SPLIT_MIN_COPIES, metavar="N",
                        help="with --issue-threads above 1: the fewest copies in one call that are split among "
                             "the threads (a shorter call is issued by the copy lane alone) "
                             f"[default {SPLIT_MIN_COPIES}]")
    parser.add_argument("--store-yield-ms", type=float, default=STORE_YIELD_MS, metavar="MS",
                        help="loads first: a store from the engine to G2 waits between its pieces while a load "
                             "from G2 runs on this worker (the two share the host link: a 20K load took 59 ms alone, "
                             "71-79 ms beside a store on an H200), at most this long in all per store job and "
                             f"never past its deadline; 0: stores never wait [default {STORE_YIELD_MS:g}]")
    parser.add_argument("--switch-interval-ms", type=float, default=SWITCH_INTERVAL_MS, metavar="MS",
                        help="Python's thread switch interval in this daemon: at most how long a copy lane waits "
                             "for the interpreter lock while another thread holds it (Python's own default is 5; "
                             "beside vLLM on an H100 a lane issuing a load's copies waited for it) "
                             f"[default {SWITCH_INTERVAL_MS}]")
    add_config_arguments(parser)
    return parser


def data_path(args: argparse.Namespace) -> DataPath:
    """The data path the arguments select (``--cuda-copy`` needs ``--gpu``)."""
    mechanism = CopyMechanism(args.cuda_copy)
    if args.gpu is None and mechanism is not CopyMechanism.AUTO:
        raise KvbmConfigError("--cuda-copy applies to the GPU data path: give --gpu DEVICE")
    if not 0 < args.load_piece_mb <= 1 << 20 or args.load_ahead < 0:
        raise KvbmConfigError(f"--load-piece-mb must be in (0, {1 << 20}] and --load-ahead >= 0")
    if not 1 <= args.issue_threads <= MAX_ISSUE_THREADS:
        raise KvbmConfigError(f"--issue-threads must be in [1, {MAX_ISSUE_THREADS}]")
    if not args.issue_threads <= args.issue_split_copies <= MAX_SPLIT_MIN_COPIES:
        raise KvbmConfigError(f"--issue-split-copies must be in [--issue-threads, {MAX_SPLIT_MIN_COPIES}]")
    if not 0 <= args.store_yield_ms <= MAX_STORE_YIELD_MS:
        raise KvbmConfigError(f"--store-yield-ms must be in [0, {MAX_STORE_YIELD_MS:g}]")
    if not 0 < args.switch_interval_ms <= 1000:
        raise KvbmConfigError("--switch-interval-ms must be in (0, 1000]")
    pacing = GroupPacing(int(args.load_piece_mb * (1 << 20)), args.load_ahead, GroupShape(args.load_group_shape))
    return DataPath(gpu=args.gpu, cuda_copy=mechanism, prefer_nixl=not args.no_nixl, pacing=pacing,
                    issue_threads=args.issue_threads, issue_split_copies=args.issue_split_copies,
                    store_yield_ms=args.store_yield_ms, stage_bytes=stage_bytes(args.stage_mib))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(f"kvbm-worker-{args.worker_id}")
    try:
        config = config_from_args(args)
        path = data_path(args)
        if len(args.worker_id.encode()) > config.max_name_bytes:
            raise KvbmConfigError(f"--worker-id is longer than {config.max_name_bytes} bytes (DYN_KVBM_MAX_NAME_BYTES)")
    except KvbmConfigError as exc:
        print(f"kvbm-worker: {exc}", file=sys.stderr)
        return 2
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    rank = args.rank if args.rank is not None else (int(args.worker_id) if args.worker_id.isdigit() else 0)
    daemon = WorkerDaemon(config, args.worker_id, rank, args.listen, args.leader, path)
    import uvloop
    return int(uvloop.run(run(daemon)))


if __name__ == "__main__":
    sys.exit(main())
