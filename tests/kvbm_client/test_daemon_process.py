"""DaemonProcess: the worker daemon's process as the connector holds it (pidfd), against real
child processes listening on a unix socket."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbm_client.connectors.core.daemon_process import DaemonProcess

LISTEN = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1]); s.listen(8)
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _listener(path: Path, lives_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", LISTEN, str(path), str(lives_s)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _held(path: Path, proc: subprocess.Popen) -> DaemonProcess:
    daemon = DaemonProcess(f"unix:{path}")
    daemon.learn()
    assert daemon.held and daemon.pid == proc.pid
    return daemon


def test_a_daemon_that_exits_is_seen_gone_without_a_kill(tmp_path):
    proc = _listener(tmp_path / "w.sock", lives_s=0.3)
    daemon = _held(tmp_path / "w.sock", proc)
    assert not daemon.gone()
    assert not daemon.wait_gone(0.01)
    t0 = time.monotonic()
    assert daemon.wait_gone(10.0)
    assert time.monotonic() - t0 < 5.0
    assert proc.wait(5) == 0  # it ended on its own: never signalled
    daemon.close()


def test_a_live_daemon_is_killed_and_then_gone(tmp_path):
    proc = _listener(tmp_path / "w.sock", lives_s=60)
    daemon = _held(tmp_path / "w.sock", proc)
    assert not daemon.wait_gone(0.05)
    assert daemon.kill(5.0)
    assert daemon.gone()
    assert proc.wait(5) == -9
    daemon.close()


def test_nothing_held_counts_as_gone(tmp_path):
    daemon = DaemonProcess(f"unix:{tmp_path / 'none.sock'}")
    daemon.learn()  # nobody listens there
    assert not daemon.held
    assert daemon.gone() and daemon.wait_gone(0.0)
    assert daemon.kill(0.1) is False


@pytest.mark.parametrize("address", ["127.0.0.1:5555", "dns:///host:1"])
def test_a_tcp_address_holds_no_process(address):
    daemon = DaemonProcess(address)
    daemon.learn()
    assert not daemon.held
