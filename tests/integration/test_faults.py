"""Faults and lifecycle with real processes: kill -9, clean shutdown, kvbm serve, barrier."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable

import numpy as np
import pytest

from kvbm_client import KvbmUnavailableError, sequence_hashes
from kvbm_client.ids import WorkerId
from support.probes import wait_for


def hashes(n: int, seed: int = 0):
    return sequence_hashes([seed * 7919 + i for i in range(n * 16)], 16)


def test_kill_9_worker_gives_clear_error_then_recovers(make_node):
    node = make_node(DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="8")
    client, engines = node.ready_client()
    keys = hashes(4)
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    before = engines["0"].array.copy()
    handle = client.prepare_load(keys)  # planned and pinned while the worker is alive ...
    assert handle.num_blocks == 4
    node.signal_worker("0", signal.SIGKILL)  # ... then it dies before the copy
    start = time.monotonic()
    with pytest.raises(KvbmUnavailableError):
        client.start(handle, [10, 11, 12, 13])
        client.wait(handle)
    assert time.monotonic() - start < 5, "the client hung on a dead worker"
    # The leader noticed: the dead worker's blocks are no longer matchable.
    deadline = time.monotonic() + 5
    while client.match(keys).num_matched and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.match(keys).num_matched == 0
    assert np.array_equal(engines["0"].array, before), "a failed onboard changed engine memory"
    # The worker comes back (as a supervisor would restart it); the engine re-registers.
    node.start_worker("0")
    node.wait_attached()
    client.register_region("0", engines["0"].spec())
    client.wait_ready(30)
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    engines["0"].array[20:24] = 0
    client.wait(client.onboard(keys, [20, 21, 22, 23]))
    assert np.array_equal(engines["0"].array[20:24], engines["0"].array[0:4])


def test_a_session_reopened_before_the_workers_attached_learns_them_by_itself(make_node):
    """The leader restarts while its worker cannot attach yet (stopped): the client's keepalive
    re-opens its session, which lists no worker. Once the worker is back, the client learns it
    with a later keepalive, without being told to ``refresh_workers()``, and serves again."""
    node = make_node(DYN_KVBM_SESSION_TTL_SECS="1.5")
    client, engines = node.ready_client()
    keys = hashes(4, 3)
    first = client.session_id
    worker = node.workers[WorkerId("0")]
    worker.send_signal(signal.SIGSTOP)
    try:
        node.kill(node.leader)
        node.start_leader()
        wait_for(lambda: client.session_id != first, "the session to be re-opened", 15)
        assert not client.workers, "re-opened while no worker was attached: it lists none"
        assert client.offload(keys, [0, 1, 2, 3]).is_empty, "a leader without its workers plans nothing"
    finally:
        worker.send_signal(signal.SIGCONT)
    node.wait_attached()
    wait_for(lambda: client.workers, "the client to learn the re-attached worker", 10)
    assert list(client.workers) == ["0"]
    client.wait_ready(20)
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    client.wait(client.onboard(keys, [20, 21, 22, 23]))
    assert np.array_equal(engines["0"].array[20:24], engines["0"].array[0:4])


def test_clean_shutdown_removes_disk_files_and_sockets(make_node):
    node = make_node(DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="8")
    node.ready_client()
    assert len(list(node.disk_dir.glob("kvbm-disk-cache-*"))) == 1
    assert (node.socket_dir / "worker-0.sock").exists()
    assert oct((node.socket_dir / "leader.sock").stat().st_mode & 0o777) == "0o600"
    assert node.signal_worker("0", signal.SIGTERM) == 0
    assert list(node.disk_dir.glob("kvbm-disk-cache-*")) == []
    assert not (node.socket_dir / "worker-0.sock").exists()
    node.leader.send_signal(signal.SIGTERM)
    assert node.leader.wait(10) == 0
    assert not (node.socket_dir / "leader.sock").exists()


def test_stale_disk_file_of_a_killed_worker_is_removed_at_next_start(make_node):
    node = make_node(DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="8")
    client, engines = node.ready_client()
    node.signal_worker("0", signal.SIGKILL)
    stale = list(node.disk_dir.glob("kvbm-disk-cache-*"))
    assert len(stale) == 1
    node.start_worker("0")
    node.wait_attached()
    client.register_region("0", engines["0"].spec())
    client.wait_ready(30)
    files = list(node.disk_dir.glob("kvbm-disk-cache-*"))
    assert len(files) == 1 and files[0] != stale[0]


def test_leader_init_barrier_names_missing_workers(make_node):
    node = make_node(num_workers=2, start=False, DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS="1.5")
    leader = node.start_leader()
    node.start_worker("0")
    assert leader.wait(20) == 3
    log = (node.root / "leader.log").read_text()
    assert "workers 1 did not attach within 1.5s" in log


def test_leader_without_a_tier_refuses_to_start(make_node):
    node = make_node(start=False, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="")
    leader = node.start_leader()
    assert leader.wait(20) == 2
    assert "no cache tier configured" in (node.root / "leader.log").read_text()


def test_pins_of_a_dead_client_expire(make_node, tmp_path):
    node = make_node(DYN_KVBM_SESSION_TTL_SECS="1")
    client, engines = node.ready_client()
    keys = hashes(3)
    client.wait(client.offload(keys, [0, 1, 2]))
    script = tmp_path / "pinner.py"
    script.write_text(
        "import os, sys\nfrom kvbm_client import KvbmClient, KvbmConfig, engine_hashes\n"
        "c = KvbmClient(KvbmConfig.from_env())\n"
        f"h = c.prepare_load(engine_hashes([bytes.fromhex(x) for x in {[k.hex() for k in keys]!r}]))\n"
        "print(h.num_blocks, flush=True)\nos._exit(0)\n")
    out = subprocess.run([sys.executable, str(script)], env=node.env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "3", out.stderr
    host = next(t for t in node.status().tiers if t.tier == 2)
    assert host.pinned_blocks == 3
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if next(t for t in node.status().tiers if t.tier == 2).pinned_blocks == 0:
            break
        time.sleep(0.1)
    assert next(t for t in node.status().tiers if t.tier == 2).pinned_blocks == 0
    assert "expired: releasing its pins" in (node.root / "leader.log").read_text()


class Lines:
    """The lines a child process prints, read on a thread, so that a wait for one has a deadline
    even when the child hangs silently or has died (EOF)."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, predicate: Callable[[str], bool], timeout: float) -> bool:
        """Whether a line matching ``predicate`` comes within ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return False
            if line is None:  # EOF: the child exited
                self._queue.put(None)
                return False
            self.seen.append(line)
            if predicate(line):
                return True


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_kvbm_serve_runs_and_stops_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_KVBM_")}
    env.update(DYN_KVBM_SOCKET_DIR=str(tmp_path / "s"), DYN_KVBM_DISK_CACHE_DIR=str(tmp_path / "d"),
               DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="16", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="16",
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvbm_client.cli", "serve", "--workers", "2", "--stage-mib", "4"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Lines(proc.stdout)
    try:
        assert out.wait_for(lambda line: line.startswith("kvbm serving"), 30), "".join(out.seen)
        children = _children_of(proc.pid)
        assert len(children) == 3
        from kvbm_client import KvbmClient, KvbmConfig, ShmKvBuffer
        cfg = KvbmConfig.from_env(env)
        with KvbmClient(cfg) as client:
            bufs = [ShmKvBuffer(8, 2, 4096, directory=str(tmp_path)) for _ in range(2)]
            for i, b in enumerate(bufs):
                client.register_region(str(i), b.spec())
            client.wait_ready(30)
            status = subprocess.run([sys.executable, "-m", "kvbm_client.cli", "status"], env=env,
                                    capture_output=True, text=True, timeout=30)
            assert "ready" in status.stdout and "worker 1 rank 1" in status.stdout, status.stdout + status.stderr
            assert status.stdout.count("staging area 4.0 MiB (--stage-mib): 0 loads staged, 0 used") == 2, \
                status.stdout
            as_json = subprocess.run([sys.executable, "-m", "kvbm_client.cli", "status", "--json"], env=env,
                                     capture_output=True, text=True, timeout=30)
            from kvbm_client.local_node import worker_status
            areas = [worker_status(w["endpoint"], timeout=5, config=cfg).info.stage_bytes
                     for w in json.loads(as_json.stdout)["workers"]]
            assert areas == [4 << 20] * 2  # --stage-mib 4 reached both workers
            assert len(list((tmp_path / "d").glob("kvbm-disk-cache-*"))) == 2
            for b in bufs:
                b.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        assert list((tmp_path / "d").glob("kvbm-disk-cache-*")) == []
        assert not (tmp_path / "s" / "leader.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kvbm_serve_restarts_a_crashed_worker(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_KVBM_")}
    env.update(DYN_KVBM_SOCKET_DIR=str(tmp_path / "s"), DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="16",
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvbm_client.cli", "serve"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Lines(proc.stdout)
    try:
        assert out.wait_for(lambda line: line.startswith("kvbm serving"), 30), "".join(out.seen)
        worker = next(p for p in _children_of(proc.pid)
                      if b"kvbm_worker" in open(f"/proc/{p}/cmdline", "rb").read())
        os.kill(worker, signal.SIGKILL)
        restarted = out.wait_for(lambda line: "worker 0 exited with -9; restarting" in line, 20)
        assert restarted, "".join(out.seen)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
