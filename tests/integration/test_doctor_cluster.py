"""`kvbm doctor` against a real etcd and nats-server (started on free loopback ports by
tests/cluster/cluster_support.py): reachable, then stopped."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvbm_client.doctor import services
from kvbm_client.doctor.base import DoctorContext, DoctorOptions, Status

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from cluster_support import EtcdServer, NatsServer, binary  # noqa: E402


def need(name: str) -> None:
    if binary(name) is None:
        pytest.skip(f"{name} is not installed (tests/cluster/install_services.sh installs it)")


def ctx_of(**env: str) -> DoctorContext:
    return DoctorContext.from_env({"DYN_KVBM_CPU_CACHE_GB": "1", **env}, DoctorOptions(timeout_s=1.0))


def test_etcd_reachable_then_stopped(tmp_path: Path) -> None:
    need("etcd")
    pytest.importorskip("aetcd")
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        result = services.check_etcd(ctx_of(ETCD_ENDPOINTS=server.endpoints))
        assert result.status is Status.OK
        assert result.message.startswith("etcd 3.") and result.message.endswith(server.endpoints.split("//")[1])
    finally:
        server.stop(kill=True)
    result = services.check_etcd(ctx_of(ETCD_ENDPOINTS=server.endpoints))
    assert result.status is Status.FAIL and "unreachable within 1 s" in result.message


def test_nats_reachable_then_stopped(tmp_path: Path) -> None:
    need("nats-server")
    pytest.importorskip("nats")
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        result = services.check_nats(ctx_of(NATS_SERVER=server.url))
        assert result.status is Status.OK and result.message.startswith("nats-server 2.")
    finally:
        server.stop(kill=True)
    result = services.check_nats(ctx_of(NATS_SERVER=server.url))
    assert result.status is Status.FAIL and "ConnectionRefusedError" in result.message
