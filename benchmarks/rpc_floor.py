"""What one round trip costs on this host before any handler runs: a lookup-sized request
(13 KB: 1258 keys of 8 bytes and their framing) and a plan-sized answer (6 KB), echoed by a
server in a child process over a unix socket, three ways:

* ``raw``: a uvloop stream server and a blocking socket client (length-prefixed frames): the
  floor of the socket and of two processes' wake-ups;
* ``grpc_sync``: a grpc server on a thread pool, the client a sync stub (what a worker's
  daemon-to-daemon call and the connector's calls are made of);
* ``grpc_aio``: a grpc.aio server on uvloop (the leader's and the worker's servers) and the
  same sync stub (the connector's ``PrepareLoad``).

Each back to back and ``--gap-ms`` apart (an engine's requests arrive apart: the processes go
idle between them, and waking them is part of the cost), alternating passes; p50 per pass.

    python3 benchmarks/rpc_floor.py [--reps 150] [--passes 2] [--gap-ms 90] [--json out.json]

The 20K-token lookup's round trip was 4.5 ms on an H100 host (2026-11-27 j) of which the
leader's handler was a part; this says what the rest can be at best.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Callable

import grpc

from provenance import provenance

REQUEST_BYTES = 13_000
ANSWER_BYTES = 6_000
KINDS = ("raw", "grpc_sync", "grpc_aio")
_METHOD = "/kvbm.bench.Echo/Call"


def _answer(_request: bytes, _context: object = None) -> bytes:
    return b"a" * ANSWER_BYTES


async def _answer_async(request: bytes, context: object) -> bytes:
    return _answer(request)


def _handlers(fn: Callable) -> tuple:
    return (grpc.method_handlers_generic_handler("kvbm.bench.Echo", {"Call": grpc.unary_unary_rpc_method_handler(fn)}),)


def serve(kind: str, path: str) -> None:
    """The server of ``kind`` on the unix socket ``path`` (a child process; runs until killed)."""
    import uvloop

    if kind == "grpc_sync":
        server = grpc.server(futures.ThreadPoolExecutor(4))
        server.add_generic_rpc_handlers(_handlers(_answer))
        server.add_insecure_port(f"unix:{path}")
        server.start()
        server.wait_for_termination()
        return

    async def raw() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "little")
                writer.write(ANSWER_BYTES.to_bytes(4, "little") + _answer(await reader.readexactly(size)))

        server = await asyncio.start_unix_server(echo, path)
        await server.serve_forever()

    async def aio() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(_handlers(_answer_async))
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(raw() if kind == "raw" else aio())


def _raw_client(path: str) -> tuple[Callable[[], None], Callable[[], None]]:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)
    frame = REQUEST_BYTES.to_bytes(4, "little") + b"r" * REQUEST_BYTES

    def call() -> None:
        sock.sendall(frame)
        size = int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "little")
        assert len(sock.recv(size, socket.MSG_WAITALL)) == ANSWER_BYTES

    return call, sock.close


def _grpc_client(path: str) -> tuple[Callable[[], None], Callable[[], None]]:
    channel = grpc.insecure_channel(f"unix:{path}")
    stub = channel.unary_unary(_METHOD)
    grpc.channel_ready_future(channel).result(timeout=30)
    request = b"r" * REQUEST_BYTES

    def call() -> None:
        assert len(stub(request, timeout=10)) == ANSWER_BYTES

    return call, channel.close


def one_pass(kind: str, reps: int, gap_s: float) -> list[float]:
    """``reps`` timed round trips (ms) against a fresh server of ``kind``, ``gap_s`` apart."""
    with tempfile.TemporaryDirectory(prefix="kvbm-rpc-", dir="/tmp") as tmp:
        path = os.path.join(tmp, "s.sock")
        child = multiprocessing.get_context("spawn").Process(target=serve, args=(kind, path), daemon=True)
        child.start()
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(path):
                if time.monotonic() > deadline or not child.is_alive():
                    raise RuntimeError(f"the {kind} server did not start")
                time.sleep(0.05)
            call, close = (_raw_client if kind == "raw" else _grpc_client)(path)
            try:
                out = []
                for i in range(reps + 10):  # the first 10 warm up and are dropped
                    t = time.perf_counter()
                    call()
                    if i >= 10:
                        out.append((time.perf_counter() - t) * 1e3)
                    time.sleep(gap_s)
                return out
            finally:
                close()
        finally:
            child.kill()
            child.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=150, help="timed round trips per pass and way [150]")
    ap.add_argument("--passes", type=int, default=2, help="alternating passes [2]")
    ap.add_argument("--gap-ms", type=float, default=90.0, help="idle time between calls in the gapped runs [90]")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    record = provenance()
    runs = [(kind, gap) for kind in KINDS for gap in (0.0, args.gap_ms)]
    per: dict[str, list[float]] = {f"{k} gap {g:g} ms": [] for k, g in runs}
    for p in range(args.passes):
        for kind, gap in (runs if p % 2 == 0 else runs[::-1]):
            p50 = statistics.median(one_pass(kind, args.reps, gap / 1e3))
            per[f"{kind} gap {gap:g} ms"].append(round(p50, 3))
            print(f"pass {p} {kind} gap {gap:g} ms: p50 {p50:.3f} ms", flush=True)
    rows = [{"way": name, "p50_ms": round(statistics.median(p50s), 3), "p50_per_pass": p50s}
            for name, p50s in per.items()]
    for row in rows:
        print(f"{row['way']}: p50 {row['p50_ms']:.3f} ms (passes {row['p50_per_pass']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": record, "request_bytes": REQUEST_BYTES,
                                               "answer_bytes": ANSWER_BYTES, "reps": args.reps,
                                               "gap_ms": args.gap_ms, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
