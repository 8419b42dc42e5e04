"""Bounded soak: offload/onboard in a loop while a fault is injected every few seconds
(etcd, nats-server, a worker and the leader killed with -9 and restarted, a worker stopped
past its deadline). Reports operations done, faults survived and wrong bytes (must be 0).
``KVBM_SOAK_SECS`` sets the length (default 60 s)."""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np

from kvbm_client import KvbmError, sequence_hashes

SOAK_SECS = float(os.environ.get("KVBM_SOAK_SECS", "60"))
FAULT_EVERY = 4.0
N = 4  # blocks per operation


def pattern(seed: int, block: int, rank: int, shape) -> np.ndarray:
    return np.random.default_rng([seed, block, rank]).integers(0, 256, shape, dtype=np.uint8)


def test_soak_with_faults(etcd, nats_server, make_cluster_node):
    node = make_cluster_node("a", num_workers=2, etcd=etcd, nats=nats_server, DYN_KVBM_JOB_TIMEOUT_SECS="1.5",
                             DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="16", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="32",
                             DYN_KVBM_HOST_FREE_WATERMARK="0.25", DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER="true",
                             DYN_KVBM_SESSION_TTL_SECS="3")
    client, engines = node.ready_client()
    shape = engines["0"].array.shape[1:]
    stop = threading.Event()
    faults: list[str] = []
    fault_errors: list[str] = []

    def restart_worker() -> None:
        node.signal_worker("1", signal.SIGKILL)
        node.start_worker("1")

    def restart_leader() -> None:
        node.leader.send_signal(signal.SIGKILL)
        node.leader.wait(5)
        node.start_leader()

    def slow_worker() -> None:
        proc = node.workers["0"]
        proc.send_signal(signal.SIGSTOP)
        time.sleep(2.0)  # longer than the job deadline
        proc.send_signal(signal.SIGCONT)

    injectors = [("etcd restart", lambda: etcd.restart(kill=True, down_for=0.5)),
                 ("nats restart", lambda: nats_server.restart(kill=True, down_for=0.5)),
                 ("worker kill -9", restart_worker), ("slow worker", slow_worker),
                 ("leader kill -9", restart_leader)]

    def inject() -> None:
        i = 0
        while not stop.wait(FAULT_EVERY):
            name, fn = injectors[i % len(injectors)]
            try:
                fn()
                faults.append(name)
            except Exception as exc:  # pragma: no cover - reported below
                fault_errors.append(f"{name}: {exc!r}")
            i += 1

    def ensure_regions() -> None:
        """What a connector does after an error: re-register where the region is gone."""
        try:
            client.refresh_workers()
        except KvbmError:
            return
        for w, engine in engines.items():
            try:
                client.register_region(w, engine.spec())
            except KvbmError:
                pass  # still registered (ALREADY_EXISTS) or the worker is not back yet

    stored: list[int] = []
    ops = errors = wrong = loaded_blocks = 0
    max_latency = 0.0
    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    end = time.monotonic() + SOAK_SECS
    rng = random.Random(0)
    seed = 0
    try:
        while time.monotonic() < end:
            seed += 1
            keys = sequence_hashes([seed * 100_003 + i for i in range(N * 16)], 16)
            t0 = time.monotonic()
            try:
                if stored and rng.random() < 0.5:
                    s = rng.choice(stored[-20:])
                    skeys = sequence_hashes([s * 100_003 + i for i in range(N * 16)], 16)
                    handle = client.onboard(skeys, list(range(8, 8 + N)))
                    client.wait(handle)
                    for w, e in engines.items():
                        for i in range(handle.num_blocks):
                            wrong += int(np.count_nonzero(e.array[8 + i] != pattern(s, i, int(w), shape)))
                    loaded_blocks += handle.num_blocks
                else:
                    for w, e in engines.items():
                        for i in range(N):
                            e.array[i] = pattern(seed, i, int(w), shape)
                    handle = client.offload(keys, list(range(N)))
                    client.wait(handle)
                    if handle.num_blocks == N:
                        stored.append(seed)
                ops += 1
            except KvbmError:
                errors += 1
                ensure_regions()
                time.sleep(0.05)
            max_latency = max(max_latency, time.monotonic() - t0)
    finally:
        stop.set()
        injector.join(15)
    # After the last fault: hits again without manual steps beyond the connector's re-register.
    deadline = time.monotonic() + 30
    recovered = False
    keys = sequence_hashes([40_000 * 100_003 + i for i in range(N * 16)], 16)
    while time.monotonic() < deadline and not recovered:
        try:
            for w, e in engines.items():
                for i in range(N):
                    e.array[i] = pattern(40_000, i, int(w), shape)
            client.wait(client.offload(keys, list(range(N))))
            handle = client.onboard(keys, list(range(8, 8 + N)))
            client.wait(handle)
            recovered = handle.num_blocks == N
        except KvbmError:
            pass
        if not recovered:
            # A miss without an error (a restarted worker whose pools wait for our layout) needs
            # the same re-registration as an error does.
            ensure_regions()
            time.sleep(0.2)
    for w, e in engines.items():
        wrong += int(np.count_nonzero(e.array[8:8 + N] != e.array[0:N])) if recovered else 0
    print(f"\nsoak {SOAK_SECS:.0f}s: {ops} operations ok, {errors} failed (degraded to misses), "
          f"{loaded_blocks} blocks onboarded and checked, faults survived {len(faults)} "
          f"({', '.join(sorted(set(faults)))}), wrong bytes {wrong}, slowest op {max_latency:.2f}s")
    assert not fault_errors, fault_errors
    assert wrong == 0
    assert recovered, "no hits after the last fault"
    assert len(faults) >= min(5, int(SOAK_SECS / FAULT_EVERY) - 1)
    assert ops > errors and loaded_blocks > 0
    assert max_latency < 1.5 * 2 + 5 + 10 + 2, "an operation hung past the configured timeouts"
