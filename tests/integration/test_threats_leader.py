"""The leader's side of the trust boundary, against real daemons (issue 11 rows 4, 5, 9, 11).

A hostile or buggy client reaches the leader's socket with the generated stubs and no daemon
token. Each test asserts the precise status, that the node's state did not change, and that
the data path still returns the right bytes afterwards.
"""
from __future__ import annotations

import os
import time

import grpc
import numpy as np
import pytest

from kvbm_client import sequence_hashes
from kvbm_client.channels import open_channel
from kvbm_client.contract import pb, rpc
from kvbm_client.security import load_node_key

CODE = grpc.StatusCode


def hashes(n: int, seed: int = 0) -> list[bytes]:
    return sequence_hashes([seed * 7919 + i for i in range(n * 16)], 16)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def details_of(call) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.details() or ""


@pytest.fixture
def stranger(make_node):
    """A node of two expected workers with only worker 0 running, and a client's raw stub
    (no daemon token) to its leader."""
    node = make_node(num_workers=2, start=False)
    node.start_leader()
    node.start_worker("0")
    node.wait_attached(1)
    channel = open_channel(node.leader_address, node.config())
    yield node, rpc.LeaderStub(channel)
    channel.close()


def test_worker_rpcs_refuse_a_client_and_change_nothing(stranger):
    node, leader = stranger
    before = node.status()
    session = leader.OpenSession(pb.OpenSessionRequest(client_name="mallory")).session_id
    # Attach as the expected-but-absent worker 1: no stream, no Welcome, no key.
    stream = leader.Attach(pb.AttachRequest(worker_id="1", rank=1, endpoint="unix:/tmp/evil.sock", pid=1))
    assert code_of(lambda: next(iter(stream))) == CODE.UNAUTHENTICATED
    calls = {
        "SetLayout": lambda: leader.SetLayout(pb.SetLayoutRequest(worker_id="0", layout=pb.KvLayout(
            num_layers=1, page_bytes=1, dtype="uint8", num_engine_blocks=1))),
        "PoolsReady": lambda: leader.PoolsReady(pb.PoolsReadyRequest(worker_id="0", epoch=1, ok=True)),
        "StartTransfer": lambda: leader.StartTransfer(pb.StartTransferRequest(worker_id="0", job_id=1, epoch=1)),
        "CompleteTransfer": lambda: leader.CompleteTransfer(pb.CompleteTransferRequest(worker_id="0", job_id=1,
                                                                                       ok=True)),
    }
    for name, call in calls.items():
        assert code_of(call) == CODE.UNAUTHENTICATED, name
    after = node.status()
    assert [w.worker_id for w in after.workers] == ["0"], "nobody attached as worker 1"
    assert [(t.tier, t.capacity_blocks) for t in after.tiers] == [(t.tier, t.capacity_blocks) for t in before.tiers]
    assert after.leader_id == before.leader_id
    leader.CloseSession(pb.CloseSessionRequest(session_id=session))


def test_forged_completion_never_makes_a_store_matchable(make_node):
    node = make_node(DYN_KVBM_JOB_TIMEOUT_SECS="1")
    client, engines = node.ready_client()
    array = engines["0"].array
    keys = hashes(4, seed=1)
    store = client.prepare_store(keys)  # the client never copies it
    assert store.num_blocks == 4
    with open_channel(node.leader_address, node.config()) as channel:
        leader = rpc.LeaderStub(channel)
        forged = pb.CompleteTransferRequest(worker_id="0", job_id=store.job_id, ok=True)
        assert code_of(lambda: leader.CompleteTransfer(forged)) == CODE.UNAUTHENTICATED
    assert client.match(keys).num_matched == 0, "a block nobody wrote became matchable"
    assert node.status().pending_jobs == 1
    client.release(store)  # its slots stay reserved until it expires (deadline + grace)
    end = time.monotonic() + 15
    while node.status().pending_jobs and time.monotonic() < end:
        time.sleep(0.1)
    assert node.status().pending_jobs == 0
    assert client.match(keys).num_matched == 0
    # The genuine path still round-trips the right bytes.
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    array[10:14] = 0
    client.wait(client.onboard(keys, [10, 11, 12, 13]))
    assert np.array_equal(array[10:14], array[0:4])


def test_a_store_larger_than_the_tier_is_refused_not_a_flush(make_node):
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="8")
    client, engines = node.ready_client()
    kept = hashes(4, seed=2)
    client.wait(client.offload(kept, [0, 1, 2, 3]))
    with open_channel(node.leader_address, node.config()) as channel:
        leader = rpc.LeaderStub(channel)
        huge = pb.PrepareStoreRequest(session_id=client.aio.session_id, hashes=hashes(9, seed=3))
        message = details_of(lambda: leader.PrepareStore(huge))
        assert code_of(lambda: leader.PrepareStore(huge)) == CODE.RESOURCE_EXHAUSTED
    assert "9 new blocks" in message and "G2 holds 8" in message
    assert client.match(kept).num_matched == 4, "the refused request evicted someone's blocks"
    # A request that fits still evicts at most one block per block it stores.
    store = client.prepare_store(hashes(6, seed=4))
    assert store.num_blocks == 6
    counters = node.status().counters
    assert counters["kvbm_evicted_blocks"] <= 6
    client.release(store)


def test_sessions_are_bounded_and_ttls_clamped(make_node):
    node = make_node(DYN_KVBM_MAX_SESSIONS="3", DYN_KVBM_MAX_SESSION_TTL_SECS="30")
    with open_channel(node.leader_address, node.config()) as channel:
        leader = rpc.LeaderStub(channel)
        granted = leader.OpenSession(pb.OpenSessionRequest(client_name="a", ttl_ms=4_000_000_000))
        assert granted.ttl_ms == 30_000, "a 46-day TTL was not clamped to DYN_KVBM_MAX_SESSION_TTL_SECS"
        leader.OpenSession(pb.OpenSessionRequest(client_name="b"))
        leader.OpenSession(pb.OpenSessionRequest(client_name="c"))
        fourth = lambda: leader.OpenSession(pb.OpenSessionRequest(client_name="d"))  # noqa: E731
        assert code_of(fourth) == CODE.RESOURCE_EXHAUSTED
        assert node.status().sessions == 3
        leader.CloseSession(pb.CloseSessionRequest(session_id=granted.session_id))
        assert leader.OpenSession(pb.OpenSessionRequest(client_name="d")).session_id
        long_name = lambda: leader.OpenSession(pb.OpenSessionRequest(client_name="x" * 257))  # noqa: E731
        assert code_of(long_name) == CODE.INVALID_ARGUMENT


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_60_mb_match_is_refused_before_the_leader_reads_it(make_node):
    node = make_node()
    rss = _rss_bytes(node.leader.pid)
    session = node.client().aio.session_id
    big = pb.MatchRequest(session_id=session, hashes=[os.urandom(60) for _ in range(1_000_000)])
    assert big.ByteSize() > 60_000_000
    channel = grpc.insecure_channel(node.leader_address, options=[("grpc.max_send_message_length", -1)])
    try:
        assert code_of(lambda: rpc.LeaderStub(channel).Match(big, timeout=30)) == CODE.RESOURCE_EXHAUSTED
    finally:
        channel.close()
    time.sleep(0.5)
    grown = _rss_bytes(node.leader.pid) - rss
    assert grown < 100 << 20, f"the leader grew by {grown >> 20} MB on a refused request"
    assert node.leader.poll() is None and node.status().sessions == 1, "the leader still serves"


class DaemonLink:
    """Plays worker 1 of the node with the node key, as the operator could."""

    def __init__(self, node) -> None:
        key = load_node_key(node.config().resolved_node_key_file)
        self.channel = open_channel(node.leader_address, node.config(), daemon_token=key.daemon_token)
        self.stub = rpc.LeaderStub(self.channel)
        self.stream = self.stub.Attach(pb.AttachRequest(worker_id="1", rank=1, endpoint="unix:/nonexistent", pid=1))
        assert next(iter(self.stream)).WhichOneof("event") == "welcome"

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


def test_layouts_that_would_give_no_blocks_are_refused(make_node):
    node = make_node(num_workers=2, start=False, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="",
                     DYN_KVBM_CPU_CACHE_GB="0.1")
    node.start_leader()
    node.wait_attached(0)
    link = DaemonLink(node)
    try:
        def set_layout(layers: int, page: int, blocks: int = 32, dtype: str = "uint8"):
            return lambda: link.stub.SetLayout(pb.SetLayoutRequest(worker_id="1", layout=pb.KvLayout(
                num_layers=layers, page_bytes=page, dtype=dtype, num_engine_blocks=blocks, rank=1)))

        message = details_of(set_layout(5000, 65536))  # 327.68 MB per block > 0.1 GB of G2
        assert "G2 would hold 0 blocks" in message and "327680000 bytes" in message and "100000000" in message
        assert code_of(set_layout(5000, 65536)) == CODE.INVALID_ARGUMENT
        assert code_of(set_layout(50002, 4096)) == CODE.INVALID_ARGUMENT  # the layer bound
        assert code_of(set_layout(0, 4096)) == CODE.INVALID_ARGUMENT
        assert code_of(set_layout(2, 0)) == CODE.INVALID_ARGUMENT
        assert code_of(set_layout(2, 4096, blocks=0)) == CODE.INVALID_ARGUMENT
        assert code_of(set_layout(2, 4096, dtype="x" * 300)) == CODE.INVALID_ARGUMENT
        worker_1 = next(w for w in node.status().workers if w.worker_id == "1")
        assert worker_1.state == "waiting-for-engine", "a refused layout was recorded"
        link.stub.SetLayout(pb.SetLayoutRequest(worker_id="1", layout=pb.KvLayout(
            num_layers=2, page_bytes=4096, dtype="uint8", num_engine_blocks=32, rank=1)))
        assert next(w for w in node.status().workers if w.worker_id == "1").layout.num_layers == 2
    finally:
        link.close()


def test_names_are_bounded(make_node):
    node = make_node(num_workers=2, start=False, DYN_KVBM_MAX_NAME_BYTES="64")
    node.start_leader()
    node.wait_attached(0)
    key = load_node_key(node.config().resolved_node_key_file)
    with open_channel(node.leader_address, node.config(), daemon_token=key.daemon_token) as channel:
        stub = rpc.LeaderStub(channel)
        for request in (pb.AttachRequest(worker_id="1" * 65, rank=1, endpoint="unix:/x"),
                        pb.AttachRequest(worker_id="1", rank=1, endpoint="unix:/" + "x" * 64)):
            assert code_of(lambda: next(iter(stub.Attach(request)))) == CODE.INVALID_ARGUMENT
    assert node.status().workers == []
