"""Does one huge request stall the leader? A real node (leader + worker child processes),
G2 of ``--capacity`` blocks, and another client's ``KeepAlive`` latency measured from its own
process while one client sends a ``--keys``-key ``PrepareStore``:

  * ``full``:    G2 full of ready blocks (every key evicts one: the request evicts the tier);
  * ``pending``: G2 full of pending slots (a store nobody copied: nothing may be evicted).

Each pass starts a fresh node, fills G2 with ready blocks through the worker, measures
``full`` (which leaves G2 full of pending slots: its own job is never copied), then
``pending``. Reported per scenario: KeepAlive p50 / p99 / max over the prober's samples
from 0.2 s before the request to its answer, and the PrepareStore time; medians over passes.

    python benchmarks/leader_stall.py [--passes 3] [--keys 65536] [--capacity 65536] [--json FILE]

To measure an older commit, run this script with ``PYTHONPATH`` at a checkout of it (the
daemons and the client then run that code; ``--timeout`` bounds a request that never answers).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import provenance

from kvbm_client.local_node import LocalNode, isolated_env

PROBE_INTERVAL = 0.002  # seconds between two KeepAlives of the prober


# ---------------------------------------------------------------------------- prober
def _probe(address: str, out: str, stop: str, timeout: str) -> None:
    """Child process: KeepAlive every PROBE_INTERVAL until ``stop`` exists (or one call times
    out: a leader that never answers); writes [(start, seconds), ...] to ``out``."""
    import grpc

    from kvbm_client.contract import pb, rpc
    channel = grpc.insecure_channel(address)  # unix socket; the same on every commit measured
    stub = rpc.LeaderStub(channel)
    session = stub.OpenSession(pb.OpenSessionRequest(client_name="stall-prober"), timeout=10).session_id
    samples = []
    while not os.path.exists(stop):
        t = time.monotonic()
        try:
            stub.KeepAlive(pb.KeepAliveRequest(session_id=session), timeout=float(timeout))
        except grpc.RpcError:  # no answer within the timeout: recorded as that long, and we stop
            samples.append((t, time.monotonic() - t))
            break
        samples.append((t, time.monotonic() - t))
        time.sleep(PROBE_INTERVAL)
    Path(out).write_text(json.dumps(samples))


# ---------------------------------------------------------------------------- node
def _node(root: Path, capacity: int, timeout: float) -> LocalNode:
    """A leader and one CPU worker (not yet started), G2 of ``capacity`` blocks, nothing freed in
    the background, jobs and sessions that outlive the measured requests."""
    env = isolated_env(root, {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": capacity,
                              "DYN_LOG": os.environ.get("KVBM_STALL_LOG", "warning"),
                              "DYN_KVBM_HOST_FREE_WATERMARK": 0,
                              "DYN_KVBM_JOB_TIMEOUT_SECS": max(60.0, 4 * timeout), "DYN_KVBM_SESSION_TTL_SECS": 60,
                              "DYN_KVBM_MAX_SESSION_TTL_SECS": 600})
    return LocalNode(env, 1, log_dir=root)


def _keys(tag: int, n: int) -> list[bytes]:
    return [(tag << 40 | i).to_bytes(8, "big") for i in range(n)]


def _fill(client: Any, capacity: int, engine_blocks: int) -> None:
    """G2 full of ready blocks, written by the worker."""
    keys = _keys(1, capacity)
    for start in range(0, capacity, engine_blocks):
        batch = keys[start:start + engine_blocks]
        client.wait(client.offload(batch, list(range(len(batch)))))


def _stats(samples: list[tuple[float, float]], t0: float, t1: float) -> dict[str, float]:
    window = sorted(s for t, s in samples if t0 - 0.2 <= t <= t1) or [float("nan")]

    def q(p: float) -> float:
        return window[min(len(window) - 1, int(p * len(window)))] * 1e3
    return {"p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": max(window) * 1e3, "samples": len(window)}


def _measure(stub: Any, session: str, address: str, root: Path, tag: int, keys: int,
             timeout: float) -> dict[str, Any]:
    import grpc

    from kvbm_client.contract import pb
    out, stop = root / f"probe-{tag}.json", root / f"stop-{tag}"
    prober = subprocess.Popen([sys.executable, __file__, "--probe", address, str(out), str(stop), str(timeout)])
    time.sleep(1.0)  # the prober has a session and is sampling
    request = pb.PrepareStoreRequest(session_id=session, hashes=_keys(tag, keys))
    t0 = time.monotonic()
    result: dict[str, Any] = {}
    try:
        resp = stub.PrepareStore(request, timeout=timeout)
        result.update(planned=len(resp.indices), skipped_full=resp.skipped_full)
    except grpc.RpcError as exc:
        result.update(error=f"{exc.code().name}: {exc.details()}")
    t1 = time.monotonic()
    time.sleep(0.3)
    stop.touch()
    prober.wait(timeout + 60)
    samples = json.loads(out.read_text()) if out.exists() else []
    result.update(prepare_store_ms=(t1 - t0) * 1e3, keepalive=_stats(samples, t0, t1))
    return result


def one_pass(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    import grpc

    from kvbm_client import KvbmClient, ShmKvBuffer
    from kvbm_client.contract import pb, rpc
    node = _node(root, args.capacity, args.timeout).start(wait=False)
    try:
        config = node.config()
        client = KvbmClient(config, client_name="stall-filler")
        engine = ShmKvBuffer(args.engine_blocks, 1, args.page_bytes, directory=str(root))
        client.register_region("0", engine.spec())
        client.wait_ready(120)
        _fill(client, args.capacity, args.engine_blocks)
        address = config.resolved_leader_address
        channel = grpc.insecure_channel(address)
        stub = rpc.LeaderStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(client_name="stall-storer", ttl_ms=600_000),
                                   timeout=10).session_id
        out = {"full": _measure(stub, session, address, root, 2, args.keys, args.timeout)}
        out["pending"] = _measure(stub, session, address, root, 3, args.keys, args.timeout)
        channel.close()
        client.close()
        engine.close()
        return out
    finally:
        node.stop()


def _median(passes: list[dict[str, Any]], scenario: str) -> dict[str, float]:
    fields = {"prepare_store_ms": lambda r: r["prepare_store_ms"]}
    for f in ("p50_ms", "p99_ms", "max_ms"):
        fields["keepalive_" + f] = lambda r, f=f: r["keepalive"][f]
    return {name: statistics.median(get(p[scenario]) for p in passes) for name, get in fields.items()}


def _provenance() -> dict[str, Any]:
    """Where the result came from (``benchmarks/provenance.py``), plus the checkout whose kvbm ran
    (``code``: it may differ from the benchmark's own tree when PYTHONPATH points at another one,
    as for a "before" run of an older commit; ``KVBM_BENCH_CODE_COMMIT`` names its commit)."""
    import kvbm_client
    return {**provenance(), "code": str(Path(kvbm_client.__file__).resolve().parents[1]),
            "code_commit": os.environ.get("KVBM_BENCH_CODE_COMMIT")}


def run_stall_benchmark(passes: int = 3, keys: int = 65536, capacity: int = 65536, engine_blocks: int = 4096,
                        page_bytes: int = 4096, timeout: float = 120.0) -> dict[str, Any]:
    """Run ``passes`` passes (fresh node each) and return the per-pass results, their medians per
    scenario, and the provenance of the run."""
    args = argparse.Namespace(keys=keys, capacity=capacity, engine_blocks=engine_blocks, page_bytes=page_bytes,
                              timeout=timeout)
    runs = []
    for i in range(passes):
        with tempfile.TemporaryDirectory(prefix="kvbm-stall-") as tmp:
            runs.append(one_pass(Path(tmp), args))
        print(f"pass {i + 1}/{passes}: {json.dumps(runs[-1])}", file=sys.stderr)
    return {"provenance": _provenance(), "params": vars(args), "passes": runs,
            "median": {s: _median(runs, s) for s in ("full", "pending")}}


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "--probe":
        _probe(*sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--keys", type=int, default=65536, help="hashes in the measured PrepareStore")
    p.add_argument("--capacity", type=int, default=65536, help="G2 blocks")
    p.add_argument("--engine-blocks", type=int, default=4096, help="engine blocks used to fill G2")
    p.add_argument("--page-bytes", type=int, default=4096)
    p.add_argument("--timeout", type=float, default=120.0, help="longest wait for one PrepareStore (s)")
    p.add_argument("--json", default=None, help="write the result here")
    a = p.parse_args()
    result = run_stall_benchmark(a.passes, a.keys, a.capacity, a.engine_blocks, a.page_bytes, a.timeout)
    text = json.dumps(result, indent=1)
    if a.json:
        Path(a.json).write_text(text + "\n")
    print(json.dumps(result["median"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
