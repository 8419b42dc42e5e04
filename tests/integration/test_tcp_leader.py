"""The leader on TCP (issue 11 row 12): refused without TLS and client authentication unless
``--insecure``; with a certificate and client tokens, clients need a token and workers attach
over TLS with the daemon token. Real daemons, a self-signed certificate made by openssl."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvbm_client import KvbmClient, KvbmConfig, sequence_hashes
from kvbm_client.channels import open_channel
from kvbm_client.contract import pb, rpc

CODE = grpc.StatusCode


def _wait_serving(config: KvbmConfig, timeout: float = 30.0) -> "pb.StatusResponse":
    end = time.monotonic() + timeout
    while True:
        try:
            with open_channel(config.resolved_leader_address, config) as channel:
                return rpc.LeaderStub(channel).Status(pb.StatusRequest(), timeout=2)
        except grpc.RpcError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def test_tcp_without_tls_is_refused_unless_insecure(make_node, free_port):
    node = make_node(start=False)
    address = f"127.0.0.1:{free_port()}"
    refused = node.start_leader("--listen", address)
    assert refused.wait(30) == 2
    log = (node.root / "leader.log").read_text()
    assert "refusing to listen on TCP" in log and "--insecure" in log
    node.start_leader("--listen", address, "--insecure")
    config = KvbmConfig.from_env({**node.env, "DYN_KVBM_LEADER_ADDRESS": address, "DYN_KVBM_INSECURE_TCP": "true"})
    assert _wait_serving(config).leader_id
    assert "WITHOUT TLS" in (node.root / "leader.log").read_text()


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key, tokens = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "tokens"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    tokens.write_text("# clients of this node\ns3cret-token\n")
    return {"cert": str(cert), "key": str(key), "tokens": str(tokens)}


def test_tls_and_tokens_on_tcp(make_node, free_port, tls_files):
    address = f"127.0.0.1:{free_port()}"
    node = make_node(start=False, DYN_KVBM_LEADER_ADDRESS=address, DYN_KVBM_TLS_CERT=tls_files["cert"],
                     DYN_KVBM_TLS_KEY=tls_files["key"], DYN_KVBM_TLS_CA=tls_files["cert"],
                     DYN_KVBM_CLIENT_TOKEN_FILE=tls_files["tokens"])
    node.start_leader()
    node.start_worker("0")  # attaches over TLS with the daemon token
    with_token = node.config()
    without_token = KvbmConfig.from_env({k: v for k, v in node.env.items() if k != "DYN_KVBM_CLIENT_TOKEN_FILE"})
    end = time.monotonic() + 30
    while not _wait_serving(with_token).workers and time.monotonic() < end:
        time.sleep(0.1)
    assert [w.worker_id for w in _wait_serving(with_token).workers] == ["0"]
    with open_channel(address, without_token) as channel:
        stub = rpc.LeaderStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenSession(pb.OpenSessionRequest(client_name="no-token"), timeout=20, wait_for_ready=True)
        assert info.value.code() == CODE.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            stub.Status(pb.StatusRequest(), timeout=20, wait_for_ready=True)
        assert info.value.code() == CODE.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:  # a plaintext client cannot even talk to it
        with grpc.insecure_channel(address) as plain:
            rpc.LeaderStub(plain).Status(pb.StatusRequest(), timeout=5)
    assert info.value.code() == CODE.UNAVAILABLE
    client = KvbmClient(with_token, client_name="tls-client")
    try:
        engine = node.engine(num_blocks=16, num_layers=2, page_bytes=4096)
        client.register_region("0", engine.spec())
        client.wait_ready(30)
        keys = sequence_hashes(list(range(4 * 16)), 16)
        client.wait(client.offload(keys, [0, 1, 2, 3]))
        engine.array[8:12] = 0
        client.wait(client.onboard(keys, [8, 9, 10, 11]))
        assert np.array_equal(engine.array[8:12], engine.array[0:4])
    finally:
        client.close()
