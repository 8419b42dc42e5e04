"""A load started early (by the vLLM scheduler role) and asked for again (by the worker role):
the worker daemon runs each plan once and answers every caller with its outcome."""
from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from kvbm_client import sequence_hashes
from kvbm_client.channels import open_channel
from kvbm_client.connectors.core import ConnectorSettings, EarlyLoads, LoadSpec
from kvbm_client.connectors.core.region_ids import EngineRegionIds
from kvbm_client.contract import pb, rpc
from kvbm_client.leader_session import LeaderSession


def hashes(n: int, seed: int = 0):
    return sequence_hashes([seed * 7919 + i for i in range(n * 16)], 16)


ENGINE = "engine-under-test"


def settings(node) -> ConnectorSettings:
    return ConnectorSettings(leader_address=node.leader_address,
                             worker_address_template=node.config().worker_address("{id}"),
                             namespace="test", timeout_s=5.0, retry_s=0.2, config=node.config(), engine_id=ENGINE)


class Setup:
    """Six blocks offloaded from engine blocks 0..5, a signed plan to load them back; the
    region's id published for the scheduler side, as the connector's worker side does."""

    def __init__(self, node) -> None:
        self.node = node
        self.client, engines = node.ready_client()
        self.array = engines["0"].array
        keys = hashes(6)
        self.client.wait(self.client.offload(keys, list(range(6))))
        self.session = LeaderSession(node.leader_address, timeout=5)
        self.load = self.session.prepare_load(keys)
        assert self.load.num_blocks == 6
        channel = open_channel(node.config().worker_address("0"), node.config())
        self.stub = rpc.WorkerStub(channel)
        self.region_id = self.client.region_id("0")
        assert self.region_id and not self.stub.Status(pb.WorkerStatusRequest(), timeout=5).region_id
        EngineRegionIds(node.config().resolved_socket_dir, ENGINE).publish("0", self.region_id)

    def spec(self, blocks: list[int]) -> LoadSpec:
        return LoadSpec("req-1", self.load.signed.plan, self.load.signed.signature, blocks, sync=True)

    def transfer(self, blocks: list[int]):
        return self.stub.Transfer.future(pb.TransferRequest(
            region_id=self.region_id, plan=pb.SignedPlan(plan=self.load.signed.plan, signature=self.load.signed.signature),
            engine_blocks=blocks), timeout=10)

    def counters(self) -> dict:
        return dict(self.stub.Status(pb.WorkerStatusRequest(), timeout=5).counters)


def test_a_load_started_early_is_joined_not_copied_twice(make_node):
    s = Setup(make_node())
    before = s.counters()
    early = EarlyLoads(settings(s.node), ["0"])
    try:
        dst = [40, 41, 42, 43, 44, 45]
        s.array[dst] = 0
        assert early.submit(s.spec(dst)) == 1
        answer = s.transfer(dst).result()  # the worker role's call, as in start_load_kv
        end = time.monotonic() + 10  # the early call, if it came second, joins the finished job
        while s.counters()["jobs_joined"] == before["jobs_joined"] and time.monotonic() < end:
            time.sleep(0.02)
    finally:
        early.close()
    # NOTE: either call may reach the worker first (the early one is not awaited); whichever
    # comes second joins the first's job, so the plan is copied once either way.
    assert answer.bytes == 6 * 4 * 2048
    assert np.array_equal(s.array[dst], s.array[0:6])
    after = s.counters()
    assert after["jobs_ok"] - before["jobs_ok"] == 1, "the plan was copied more than once"
    assert after["jobs_joined"] - before["jobs_joined"] == 1
    assert after["bytes_loaded"] - before["bytes_loaded"] == answer.bytes


def test_the_same_plan_into_other_blocks_is_refused_and_writes_nothing(make_node):
    s = Setup(make_node())
    s.transfer([40, 41, 42, 43, 44, 45]).result()
    s.array[50:56] = 0
    with pytest.raises(grpc.RpcError) as err:
        s.transfer([50, 51, 52, 53, 54, 55]).result()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "other engine blocks" in err.value.details()
    assert not s.array[50:56].any()


def test_a_job_whose_first_caller_went_away_still_completes(make_node):
    s = Setup(make_node())
    dst = [20, 21, 22, 23, 24, 25]
    s.array[dst] = 0
    first = s.transfer(dst)
    time.sleep(0.05)  # let it reach the worker
    first.cancel()
    answer = s.transfer(dst).result()
    assert answer.joined, "the first call never reached the worker: this test proves nothing"
    assert answer.bytes == 6 * 4 * 2048
    assert np.array_equal(s.array[dst], s.array[0:6])


def test_early_loads_without_a_worker_daemon_send_nothing_and_do_not_block(make_node, tmp_path):
    node = make_node()
    absent = ConnectorSettings(leader_address=node.leader_address,
                               worker_address_template=f"unix:{tmp_path}/no-worker-{{id}}.sock",
                               namespace="test", timeout_s=1.0, retry_s=60.0)
    early = EarlyLoads(absent, ["0"])
    try:
        start = time.monotonic()
        spec = LoadSpec("r", b"plan", b"sig", [1, 2], sync=True)
        assert early.submit(spec) == 0
        assert early.submit(spec) == 0  # backed off: not even a Status call
        assert time.monotonic() - start < 2.5
    finally:
        early.close()
