"""LocalNode's process handling (order, escalation, restart, fail-fast waits), driven with a
stand-in interpreter: a script that LocalNode runs in place of ``python -m kvbm_leader`` /
``-m kvbm_worker`` and that records what it is asked and when it gets SIGTERM. The real daemons
under LocalNode are covered by tests/integration (every fixture there is a LocalNode)."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvbm_client.errors import KvbmUnavailableError
from kvbm_client.local_node import LocalNode, isolated_env

STANDIN = """\
import os, signal, sys, time
module, args = sys.argv[2], sys.argv[3:]
name = "leader" if module == "kvbm_leader" else "worker-" + args[args.index("--worker-id") + 1]

def record(what):
    fd = os.open(os.environ["STANDIN_JOURNAL"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{what} {name} {os.getpid()} {' '.join(args)}\\n".encode())
    os.close(fd)

def on_term(signum, frame):
    record("term")
    time.sleep(float(os.environ.get("STANDIN_TERM_DELAY", "0")))
    record("exit")
    sys.exit(0)

print(f"{name} stand-in started", flush=True)
if name in os.environ.get("STANDIN_EXIT", "").split(","):
    print(f"{name} stand-in exiting with 3", flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN if name in os.environ.get("STANDIN_IGNORE_TERM", "") else on_term)
record("start")
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def standin(tmp_path: Path) -> str:
    path = tmp_path / "standin-python"
    path.write_text(f"#!{sys.executable}\n{STANDIN}")
    path.chmod(0o755)
    return str(path)


def journal(node: LocalNode) -> list[list[str]]:
    path = Path(node.env["STANDIN_JOURNAL"])
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def make(tmp_path: Path, standin: str, num_workers: int = 2, own_session: bool = False, **env: str) -> LocalNode:
    node_env = isolated_env(tmp_path, {"STANDIN_JOURNAL": str(tmp_path / "journal"), **env})
    return LocalNode(node_env, num_workers, log_dir=tmp_path / "logs", python=standin, own_session=own_session)


def started(node: LocalNode, n: int, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while sum(e[0] == "start" for e in journal(node)) < n:
        assert time.monotonic() < end, journal(node)
        time.sleep(0.02)


def test_planned_daemons_and_their_flags(tmp_path: Path, standin: str) -> None:
    node = LocalNode({}, gpus=[2, 3], worker_args=["--no-nixl"], leader_args=["--listen", "x"], python=standin)
    assert node.leader.argv == [standin, "-m", "kvbm_leader", "--num-workers", "2", "--listen", "x"]
    assert [w.argv[1:] for w in node.workers.values()] == [
        ["-m", "kvbm_worker", "--worker-id", "0", "--gpu", "2", "--no-nixl"],
        ["-m", "kvbm_worker", "--worker-id", "1", "--gpu", "3", "--no-nixl"]]
    assert node.daemons == [node.leader, *node.workers.values()]


def test_stop_takes_the_workers_down_before_the_leader(tmp_path: Path, standin: str) -> None:
    node = make(tmp_path, standin, STANDIN_TERM_DELAY="0.3").start(wait=False)
    started(node, 3)
    node.stop()
    events = [(e[0], e[1]) for e in journal(node) if e[0] in ("term", "exit")]
    leader_term = events.index(("term", "leader"))
    assert {("exit", "worker-0"), ("exit", "worker-1")} <= set(events[:leader_term]), events
    assert [d.returncode for d in node.daemons] == [0, 0, 0]
    assert (tmp_path / "logs" / "worker-1.log").read_text().startswith("worker-1 stand-in started")
    node.stop()  # idempotent


@pytest.mark.parametrize("own_session", [False, True])
def test_own_session_puts_each_daemon_in_a_session_of_its_own(tmp_path: Path, standin: str,
                                                              own_session: bool) -> None:
    node = make(tmp_path, standin, 1, own_session=own_session).start(wait=False)
    try:
        started(node, 2)
        sessions = {os.getsid(d.pid) for d in node.daemons}
        if own_session:
            assert sessions == {d.pid for d in node.daemons}  # each one leads its own
        else:
            assert sessions == {os.getsid(0)}
    finally:
        node.stop()


def test_a_daemon_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path, standin: str) -> None:
    node = make(tmp_path, standin, 1, STANDIN_IGNORE_TERM="worker-0").start(wait=False)
    started(node, 2)
    begin = time.monotonic()
    node.stop(timeout=0.5)
    assert node.workers["0"].returncode == -signal.SIGKILL and node.leader.returncode == 0
    assert time.monotonic() - begin < 5


def test_restart_runs_the_same_command_as_a_new_process(tmp_path: Path, standin: str) -> None:
    node = make(tmp_path, standin, 1).start(wait=False)
    started(node, 2)
    worker = node.workers["0"]
    first = worker.pid
    assert node.restart(worker) is worker and worker.pid != first and worker.running
    started(node, 3)
    starts = [e for e in journal(node) if e[0] == "start" and e[1] == "worker-0"]
    assert [int(e[2]) for e in starts] == [first, worker.pid] and starts[0][3:] == starts[1][3:]
    assert node.kill(worker, signal.SIGKILL) == -signal.SIGKILL
    node.start_worker("0", "--no-nixl")  # a start with flags of its own, this time
    started(node, 4)
    assert journal(node)[-1][3:] == ["--worker-id", "0", "--cpu", "--no-nixl"]
    with pytest.raises(AssertionError, match="already running"):
        node.start_worker("0")
    node.stop()


def test_waiting_fails_at_once_when_the_leader_exits(tmp_path: Path, standin: str) -> None:
    node = make(tmp_path, standin, 1, STANDIN_EXIT="leader").start(wait=False)
    begin = time.monotonic()
    with pytest.raises(KvbmUnavailableError, match="the leader exited with 3") as info:
        node.wait_attached(timeout=60)
    assert time.monotonic() - begin < 10
    assert "leader stand-in exiting with 3" in str(info.value)  # the log's tail comes with it
    node.stop()


def test_waiting_fails_at_once_when_too_few_workers_run(tmp_path: Path, standin: str) -> None:
    node = make(tmp_path, standin, 2, STANDIN_EXIT="worker-1").start(wait=False)
    with pytest.raises(KvbmUnavailableError, match=r"only 1 workers run; exited: worker 1 \(3\)"):
        node.wait_attached(timeout=60)
    node.stop()


def test_isolated_env_shares_no_setting_with_this_process(tmp_path: Path) -> None:
    base = {"DYN_KVBM_CPU_CACHE_GB": "8", "ETCD_ENDPOINTS": "http://x", "PATH": "/bin", "KEEP": "1"}
    env = isolated_env(tmp_path, {"DYN_KVBM_JOB_TIMEOUT_SECS": 5, "KEEP": ""}, drop=("ETCD_ENDPOINTS",), base=base)
    assert env == {"PATH": "/bin", "DYN_KVBM_SOCKET_DIR": str(tmp_path / "sock"), "PYTHONUNBUFFERED": "1",
                   "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path / "disk"), "DYN_KVBM_JOB_TIMEOUT_SECS": "5"}
