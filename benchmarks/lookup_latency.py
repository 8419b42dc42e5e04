"""The connector's lookup on a real node: one ``PrepareLoad`` (match, count the hit, pin) of a
stored prefix, as the scheduler role sends it for every new request, timed from the engine's
side, for one or more source trees in alternating passes; or (``--op store``) one
``PrepareStore`` of new blocks, as the scheduler role sends it in each step of a cold prefill.

    python3 benchmarks/lookup_latency.py [--op load|store|miss] [--blocks 1258] [--reps 200] [--passes 3] [--gap-ms 0]
                                         [--src DIR ...] [--variant LABEL:KEY=VALUE,... ...] [--json out.json]

``--op miss``: a cold request's lookup, ``--blocks`` keys never stored (a fresh salt each time)
while the node holds ``--blocks`` others, two ways in alternating requests: ``asked``, the
``PrepareLoad`` round trip that answers "nothing" (every lookup before the twelfth session), and
``filter``, the connector's check of the first key against the leader's presence filter (what
the scheduler role does now; the leader is told with the next call, untimed). Both report the
same miss; the "maybe" answers of the filter for those fresh keys are counted.

``--op store``: each timed ``PrepareStore`` offers ``--blocks`` keys never seen before (1024: the
first step of a 20K-token cold prefill under vLLM's 16384-token step budget) and is then released
(untimed), so the pool never fills; the leader plans a pending G2 copy per key and counts each in
the disk offload filter.

Each pass starts a leader and one CPU worker (child processes, real gRPC over unix sockets) from
each ``--src`` checkout in turn (default: this one), offloads ``--blocks`` blocks (1258: a
20K-token prompt in 16-token blocks), then times ``--reps`` lookups through
:class:`~kvbm_client.leader_session.LeaderSession` (the connector's own client), each followed
by the ``Release`` an unused hit gets (untimed). Reports, per source: the median over passes of
each pass's p50, each pass's p50 / p90, and the client-side cost alone (building the request
and reading the answer, no round trip).

The 20K-token lookup was the second-largest fixed cost of a hit's TTFT on the H100 (6.3 ms of
97 ms, 2026-11-25): this measures the leader's share of it where a GPU is not needed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from provenance import provenance

from kvbm_client import KvbmClient, KvbmConfig, ShmKvBuffer, sequence_hashes
from kvbm_client.contract import pb
from kvbm_client.handles import load_handle
from kvbm_client.leader_session import LeaderSession
from kvbm_client.local_node import LocalNode, isolated_env

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def engine_node(root: Path, env: dict[str, str], blocks: int, src: Path = REPO,
                worker_args: tuple[str, ...] = ()) -> Iterator[tuple[LocalNode, KvbmConfig, KvbmClient]]:
    """A leader and one CPU worker run from ``src`` (child processes, real gRPC over unix sockets,
    logs in ``root``), with an engine buffer of ``blocks`` blocks (2 pages of 512 bytes each)
    registered on the worker and its pools ready: the node, its config and the client that
    registered the buffer (closed, with the buffer, on exit)."""
    with LocalNode(env, 1, log_dir=root, cwd=src, worker_args=worker_args).start() as node:
        config = KvbmConfig.from_env(env)
        engine = ShmKvBuffer(blocks, 2, 512, directory=str(root))
        client = KvbmClient(config)
        try:
            client.register_region("0", engine.spec())
            client.wait_ready(60)
            yield node, config, client
        finally:
            client.close()
            engine.close()


def one_pass(src: Path, blocks: int, reps: int, op: str = "load", node_env: dict[str, str] | None = None,
             false_maybe: list[int] | None = None, gap_s: float = 0.0) -> list[float]:
    """Lookup (``op`` load) or store-planning (store) round trips (ms) against a node run from ``src``
    (``node_env``: more ``DYN_KVBM_*`` settings of its daemons; ``false_maybe``: where ``miss_filter``
    appends its count of the filter's "maybe" answers for keys never stored)."""
    with tempfile.TemporaryDirectory(prefix="kvbm-lookup-", dir="/tmp") as tmp:
        root = Path(tmp)
        # a released store's slots stay reserved until its job expires (a worker may still write
        # them): room for every timed store
        pool = blocks * (reps + 10) + 64 if op == "store" else blocks + 64
        env = isolated_env(root, {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": pool, "DYN_LOG": "warning",
                                  "DYN_KVBM_HOST_FREE_WATERMARK": "0",
                                  "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")])),
                                  **(node_env or {})})
        keys = sequence_hashes(list(range(blocks * 16)), 16)
        with engine_node(root, env, blocks, src) as (node, config, client):
            session = LeaderSession(node.leader_address, timeout=10, config=config)
            if op == "store":
                return store_samples(session, blocks, reps)
            client.wait(client.offload(keys, list(range(blocks))))
            if op in ("miss", "miss_filter"):
                return miss_samples(session, blocks, reps, op == "miss_filter", false_maybe)
            samples = []
            for i in range(reps + 10):  # the first 10 warm up and are dropped
                t = time.perf_counter()
                handle = session.prepare_load(keys, count_hit=True, tokens_per_block=16)
                ms = (time.perf_counter() - t) * 1e3
                assert handle.num_blocks == blocks, f"matched {handle.num_blocks} of {blocks}"
                session.release(handle)
                if i >= 10:
                    samples.append(ms)
                time.sleep(gap_s)
            session.close()
    return samples


def store_samples(session: LeaderSession, blocks: int, reps: int) -> list[float]:
    """``PrepareStore`` round trips (ms) of ``blocks`` new keys each, every plan released."""
    samples = []
    try:
        for i in range(reps + 10):  # the first 10 warm up and are dropped
            keys = sequence_hashes(list(range(blocks * 16)), 16, salt=i + 1)
            t = time.perf_counter()
            handle = session.prepare_store(keys)
            ms = (time.perf_counter() - t) * 1e3
            assert handle.num_blocks == blocks, f"planned {handle.num_blocks} of {blocks} (skipped " \
                                                f"{handle.skipped_present} present, {handle.skipped_full} full)"
            session.release(handle)
            if i >= 10:
                samples.append(ms)
    finally:
        session.close()
    return samples


def miss_samples(session: LeaderSession, blocks: int, reps: int, filtered: bool,
                 false_maybe: list[int] | None = None) -> list[float]:
    """Cold lookups (ms) of ``blocks`` keys never stored: the round trip, or (``filtered``) the
    presence filter's check of the first key, as the scheduler role makes it (its "maybe" answers
    for those keys appended to ``false_maybe``)."""
    samples = []
    maybe = 0
    try:
        for i in range(reps + 10):  # the first 10 warm up and are dropped
            keys = sequence_hashes(list(range(blocks * 16)), 16, salt=1_000_000 + i)
            t = time.perf_counter()
            if filtered:
                hit = session.may_hold(keys[0])
                if not hit:
                    session.unasked(blocks)
            else:
                hit = not session.prepare_load(keys, count_hit=True, tokens_per_block=16).is_empty
            ms = (time.perf_counter() - t) * 1e3
            if filtered and hit:
                maybe += 1
            elif hit:
                raise AssertionError("a key never stored matched")
            if i >= 10:
                samples.append(ms)
        if filtered and false_maybe is not None:
            false_maybe.append(maybe)
    finally:
        session.close()
    return samples


def client_side_ms(blocks: int, reps: int = 200) -> float:
    """What the client spends per lookup without the round trip: the request built and
    serialized, an answer of ``blocks`` entries parsed (median ms)."""
    keys = sequence_hashes(list(range(blocks * 16)), 16)
    plan = pb.TransferPlan(tiers=[1] * blocks, slots=list(range(blocks))).SerializeToString()
    answer = pb.PrepareLoadResponse(num_planned=blocks, plan=pb.SignedPlan(plan=plan, signature=b"s" * 32))
    wire = answer.SerializeToString()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        pb.PrepareLoadRequest(hashes=list(keys), count_hit=True, tokens_per_block=16).SerializeToString()
        load_handle(pb.PrepareLoadResponse.FromString(wire))
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def label(src: Path, op: str, variant: str = "") -> str:
    """A result row's name: the source, how a miss was answered (``--op miss``), the variant."""
    name = {"miss": f"{src} asked", "miss_filter": f"{src} filter"}.get(op, str(src))
    return f"{name} [{variant}]" if variant else name


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``LABEL:KEY=VALUE,KEY=VALUE`` (``--variant``) -> (label, settings)."""
    name, _, rest = text.partition(":")
    return name, dict(item.split("=", 1) for item in rest.split(",") if item)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=("load", "store", "miss"), default="load",
                    help="time PrepareLoad of a stored prefix (load), PrepareStore of new blocks (store), or a "
                         "cold lookup asked and answered by the presence filter (miss) [load]")
    ap.add_argument("--blocks", type=int, default=1258, help="blocks of the stored prefix (store: of each "
                                                            "request) [1258: 20K tokens]")
    ap.add_argument("--reps", type=int, default=200, help="timed lookups per pass [200]")
    ap.add_argument("--passes", type=int, default=3, help="alternating passes over the sources [3]")
    ap.add_argument("--src", action="append", default=[], help="a checkout to run the daemons from (repeat: "
                                                               "compared in one run) [this one]")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL:KEY=VALUE,... daemon settings of one variant (repeat: each source runs every "
                         "variant, alternating), e.g. off:DYN_KVBM_PRESENCE_FILTER_SLOTS=0 [one, as configured]")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="idle time after each lookup's Release (--op load): the leader's deferred work (the hit "
                         "counted, the release) done before the next lookup, as between a served engine's "
                         "requests [0: back to back]")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    record = provenance()
    srcs = [Path(s).resolve() for s in args.src] or [REPO]
    variants = [parse_variant(v) for v in args.variant] or [("", {})]
    # --op miss: each source twice per pass, asked then filtered (then the other way round)
    runs = [(src, op, v) for src in srcs for op in (("miss", "miss_filter") if args.op == "miss" else (args.op,))
            for v in variants]
    per: dict[str, list[list[float]]] = {label(src, op, v[0]): [] for src, op, v in runs}
    false_maybe: list[int] = []  # per filtered pass: the filter's "maybe" for keys never stored
    for p in range(args.passes):
        for src, op, (name, env) in (runs if p % 2 == 0 else runs[::-1]):
            samples = one_pass(src, args.blocks, args.reps, op, env, false_maybe, args.gap_ms / 1e3)
            per[label(src, op, name)].append(samples)
            q = statistics.quantiles(samples, n=10)
            print(f"pass {p} {label(src, op, name)}: p50 {statistics.median(samples):.3f} ms p90 {q[8]:.3f} ms",
                  flush=True)
    rows = []
    for src, passes in per.items():
        p50s = [statistics.median(s) for s in passes]
        p90s = [statistics.quantiles(s, n=10)[8] for s in passes]
        rows.append({"src": src, "p50_ms": round(statistics.median(p50s), 3), "p90_ms": round(statistics.median(p90s), 3),
                     "p50_per_pass": [round(x, 3) for x in p50s], "p90_per_pass": [round(x, 3) for x in p90s]})
        print(f"{src}: p50 {rows[-1]['p50_ms']:.2f} ms (passes {rows[-1]['p50_per_pass']}), "
              f"p90 {rows[-1]['p90_ms']:.2f} ms")
    client = client_side_ms(args.blocks) if args.op == "load" else None
    if client is not None:
        print(f"client side alone (request built, answer read): {client:.3f} ms")
    if false_maybe:
        print(f"presence filter: 'maybe' for {sum(false_maybe)} of {len(false_maybe) * (args.reps + 10)} keys never stored")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": record, "op": args.op, "blocks": args.blocks, "reps": args.reps, "gap_ms": args.gap_ms,
                                               "rows": rows, "client_side_ms": round(client, 3) if client is not None else None,
                                               "filter_false_maybe": sum(false_maybe) if false_maybe else None},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
