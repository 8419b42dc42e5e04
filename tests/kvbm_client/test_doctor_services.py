"""`kvbm doctor`'s service checks without servers: the socket directory's ownership and mode,
the metrics port, and etcd / NATS endpoints where nothing listens (a closed port).
Reachable etcd and NATS: tests/integration/test_doctor_cluster.py."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from kvbm_client.doctor import services
from kvbm_client.doctor.base import DoctorContext, DoctorOptions, Status


def ctx_of(tmp_path: Path, **env: str) -> DoctorContext:
    base = {"DYN_KVBM_SOCKET_DIR": str(tmp_path / "sock"), "DYN_KVBM_CPU_CACHE_GB": "1"}
    return DoctorContext.from_env({**base, **env}, DoctorOptions(timeout_s=1.0))


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- services.socket_dir ------------------------------------------------------------------
def test_socket_dir_0700_is_ok(tmp_path: Path) -> None:
    (tmp_path / "sock").mkdir(mode=0o700)
    result = services.check_socket_dir(ctx_of(tmp_path))
    assert result.status is Status.OK and result.data["mode"] == "0700"


def test_socket_dir_missing_is_ok(tmp_path: Path) -> None:
    result = services.check_socket_dir(ctx_of(tmp_path))
    assert result.status is Status.OK and "the daemons create it with mode 0700" in result.message


def test_socket_dir_0777_fails(tmp_path: Path) -> None:
    (tmp_path / "sock").mkdir()
    os.chmod(tmp_path / "sock", 0o777)
    result = services.check_socket_dir(ctx_of(tmp_path))
    assert result.status is Status.FAIL
    assert "has mode 0777: other users can reach the leader's and workers' sockets" in result.message
    assert result.remedy == f"chmod 700 {tmp_path / 'sock'}"


def test_socket_dir_symlink_fails(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "sock").symlink_to(tmp_path / "elsewhere")
    result = services.check_socket_dir(ctx_of(tmp_path))
    assert result.status is Status.FAIL
    assert result.message.startswith(f"{tmp_path / 'sock'} is a symlink (to {tmp_path / 'elsewhere'})")
    assert result.remedy.startswith(f"remove the link (rm {tmp_path / 'sock'})")


def test_socket_dir_of_another_user_fails(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    (tmp_path / "sock").mkdir(mode=0o700)
    os.chown(tmp_path / "sock", 65534, 65534)
    result = services.check_socket_dir(ctx_of(tmp_path))
    assert result.status is Status.FAIL
    assert "is owned by" in result.message and "uid 65534" in result.message
    assert "set DYN_KVBM_SOCKET_DIR to a directory of yours" in result.remedy


def test_socket_dir_that_is_a_file_fails(tmp_path: Path) -> None:
    (tmp_path / "sock").write_text("")
    result = services.check_socket_dir(ctx_of(tmp_path))
    assert result.status is Status.FAIL and result.message.endswith("is not a directory")


# ---- services.metrics_port ----------------------------------------------------------------
def test_metrics_port_free(tmp_path: Path) -> None:
    port = closed_port()
    result = services.check_metrics_port(ctx_of(tmp_path, DYN_KVBM_METRICS="true", DYN_KVBM_METRICS_PORT=str(port)))
    assert result.status is Status.OK and result.message == f"127.0.0.1:{port} free"


def test_metrics_port_taken_by_another_process_fails(tmp_path: Path) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        result = services.check_metrics_port(ctx_of(tmp_path, DYN_KVBM_METRICS="true",
                                                    DYN_KVBM_METRICS_PORT=str(port)))
    assert result.status is Status.FAIL
    assert result.message == f"127.0.0.1:{port} is in use by another process: the leader would fail to start"
    assert result.remedy.startswith("set DYN_KVBM_METRICS_PORT to a free port")


def test_metrics_addr_not_local_fails(tmp_path: Path) -> None:
    result = services.check_metrics_port(ctx_of(tmp_path, DYN_KVBM_METRICS="true", DYN_KVBM_METRICS_ADDR="192.0.2.1"))
    assert result.status is Status.FAIL
    assert result.remedy == "set DYN_KVBM_METRICS_ADDR to an address of this machine"


def test_metrics_off_skips(tmp_path: Path) -> None:
    assert services.check_metrics_port(ctx_of(tmp_path)).status is Status.SKIP


# ---- services.etcd / services.nats, nothing listening -------------------------------------
def test_etcd_unreachable_fails_fast(tmp_path: Path) -> None:
    pytest.importorskip("aetcd")
    port = closed_port()
    start = time.monotonic()
    result = services.check_etcd(ctx_of(tmp_path, ETCD_ENDPOINTS=f"http://127.0.0.1:{port}"))
    assert time.monotonic() - start < 5
    assert result.status is Status.FAIL
    assert result.message.startswith(f"etcd at 127.0.0.1:{port} unreachable within 1 s")
    assert result.remedy.startswith("start etcd or fix ETCD_ENDPOINTS")


def test_nats_unreachable_fails_fast(tmp_path: Path) -> None:
    pytest.importorskip("nats")
    port = closed_port()
    start = time.monotonic()
    result = services.check_nats(ctx_of(tmp_path, NATS_SERVER=f"nats://127.0.0.1:{port}"))
    assert time.monotonic() - start < 5
    assert result.status is Status.FAIL
    assert result.message.startswith(f"NATS at nats://127.0.0.1:{port} unreachable")
    assert result.remedy == "start nats-server or fix NATS_SERVER (nats://HOST:PORT)"


def test_cluster_checks_skip_when_not_configured(tmp_path: Path) -> None:
    ctx = ctx_of(tmp_path)
    assert services.check_etcd(ctx).status is Status.SKIP
    assert services.check_nats(ctx).status is Status.SKIP
