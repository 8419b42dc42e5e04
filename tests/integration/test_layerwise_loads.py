"""Layer-pipelined loads (``TransferLayers``) on the real daemons: the worker copies a load in
layer groups and streams the pages landed; the engine side (:class:`LayerwiseCall`, the
transfer tracker) waits per layer, and a load that fails part-way counts as failed."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from kvbm_client import sequence_hashes
from kvbm_client.channels import open_channel
from kvbm_client.connectors.core.layerwise import LayerwiseCall
from kvbm_client.connectors.core.transfers import TransferTracker
from kvbm_client.contract import pb, rpc
from kvbm_client.leader_session import LeaderSession
from support.fault_env import fault_env

LAYERS, PAGE = 8, 2048  # the test engine: 8 pages per block


def hashes(n: int, seed: int = 0):
    return sequence_hashes([seed * 7919 + i for i in range(n * 16)], 16)


class Setup:
    """Six blocks offloaded from engine blocks 0..5 and a signed plan to load them back."""

    def __init__(self, node, n: int = 6) -> None:
        self.node = node
        self.client, engines = node.ready_client(num_layers=LAYERS, page_bytes=PAGE)
        self.array = engines["0"].array
        keys = hashes(n)
        self.client.wait(self.client.offload(keys, list(range(n))))
        self.session = LeaderSession(node.leader_address, timeout=5)
        self.load = self.session.prepare_load(keys)
        assert self.load.num_blocks == n
        self.stub = rpc.WorkerStub(open_channel(node.config().worker_address("0"), node.config()))
        self.region_id = self.client.region_id("0")
        self.readers = ThreadPoolExecutor(4)

    def request(self, blocks: list[int], groups: int, plan=None) -> "pb.TransferRequest":
        signed = plan or self.load.signed
        return pb.TransferRequest(region_id=self.region_id, engine_blocks=blocks, layer_groups=groups,
                                  plan=pb.SignedPlan(plan=signed.plan, signature=signed.signature))

    def call(self, blocks: list[int], groups: int, timeout: float = 10) -> LayerwiseCall:
        return LayerwiseCall(self.stub.TransferLayers(self.request(blocks, groups), timeout=timeout), self.readers)


def test_a_load_lands_group_by_group_then_answers(make_node):
    s = Setup(make_node(**fault_env(GROUP_DELAY_SECS="0.3")))
    dst = [40, 41, 42, 43, 44, 45]
    s.array[dst] = 0
    messages = list(s.stub.TransferLayers(s.request(dst, 4), timeout=20))
    progress = [m.pages_landed for m in messages if not m.HasField("done")]
    # 4 groups of 8 pages, front-loaded (the daemon's default shape): ends 4, 6, 7, 8; every group
    # after the first lands 0.3 s late, so each is its own message (the last group's may come with
    # the outcome, in the last message)
    assert progress in ([4, 6, 7], [4, 6, 7, 8]), progress
    assert all(m.pages_per_block == LAYERS for m in messages)
    assert messages[-1].HasField("done") and messages[-1].pages_landed == LAYERS
    assert messages[-1].done.bytes == 6 * LAYERS * PAGE
    assert np.array_equal(s.array[dst], s.array[0:6])


def test_the_engine_side_waits_per_layer(make_node):
    """wait_pages returns once a layer's pages landed, before the whole load is done."""
    s = Setup(make_node(**fault_env(GROUP_DELAY_SECS="0.5")))
    dst = [20, 21, 22, 23, 24, 25]
    s.array[dst] = 0
    t0 = time.monotonic()
    call = s.call(dst, 2)
    assert call.wait_pages(4, LAYERS, time.monotonic() + 10)  # in the first group (pages 0..5)
    first = time.monotonic() - t0
    assert np.array_equal(s.array[dst][:, :4], s.array[0:6][:, :4]), "reported landed before the bytes were there"
    assert not call.done(), "the second group is 0.5 s late: the load cannot be done yet"
    assert call.wait_pages(8, LAYERS, time.monotonic() + 10)
    assert time.monotonic() - t0 >= 0.5 > first
    assert call.result(5).bytes == 6 * LAYERS * PAGE
    assert np.array_equal(s.array[dst], s.array[0:6])
    assert [p for _, p in call.landings] == [6, 8]


def test_a_joined_job_streams_the_first_callers_groups(make_node):
    """The scheduler side's early Transfer (with layer_groups) starts the job; the worker
    side's TransferLayers joins it and gets its progress."""
    s = Setup(make_node(**fault_env(GROUP_DELAY_SECS="0.3")))
    dst = [30, 31, 32, 33, 34, 35]
    early = s.stub.Transfer.future(s.request(dst, 2), timeout=10)
    time.sleep(0.1)
    messages = list(s.stub.TransferLayers(s.request(dst, 8), timeout=10))  # its own count is ignored
    assert messages[-1].done.joined
    assert [m.pages_landed for m in messages][-1] == LAYERS
    assert early.result().bytes == messages[-1].done.bytes
    assert np.array_equal(s.array[dst], s.array[0:6])


def test_more_groups_than_pages_run_one_page_per_group(make_node):
    s = Setup(make_node(**fault_env(GROUP_DELAY_SECS="0.1")))
    dst = [46, 47, 48, 49, 50, 51]
    messages = list(s.stub.TransferLayers(s.request(dst, 9), timeout=20))
    progress = [m.pages_landed for m in messages if not m.HasField("done")]
    assert progress[:7] == [1, 2, 3, 4, 5, 6, 7], progress
    assert np.array_equal(s.array[dst], s.array[0:6])


def test_a_group_count_over_the_limit_is_refused_and_writes_nothing(make_node):
    s = Setup(make_node())
    dst = [52, 53, 54, 55, 56, 57]
    s.array[dst] = 0
    with pytest.raises(grpc.RpcError) as err:
        list(s.stub.TransferLayers(s.request(dst, 65), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 64" in err.value.details()
    assert not s.array[dst].any()


def test_layer_groups_on_a_store_are_refused(make_node):
    s = Setup(make_node())
    store = s.session.prepare_store(hashes(2, seed=5))
    with pytest.raises(grpc.RpcError) as err:
        s.stub.Transfer(s.request([0, 1], 2, plan=store.signed), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "loads only" in err.value.details()


def test_a_worker_killed_mid_load_never_hangs_the_engine(make_node):
    """kill -9 of the daemon while a layer-pipelined load is queued: the engine's layer wait
    returns at once (the stream breaks), the load's blocks become load errors, and the step's
    end reports the failure (the engine recomputes)."""
    s = Setup(make_node())
    dst = [10, 11, 12, 13, 14, 15]
    s.array[dst] = 7
    pid = s.node.workers["0"].pid
    os.kill(pid, signal.SIGSTOP)  # the call is queued in a frozen daemon ...
    tracker = TransferTracker()
    try:
        call = s.call(dst, 4, timeout=30)
        tracker.load_sent("req-1", call, dst, sync=True, answer_by=time.monotonic() + 30)
        time.sleep(0.2)
        s.node.signal_worker("0", signal.SIGKILL)  # ... and dies mid-load
        t0 = time.monotonic()
        tracker.wait_sync_pages(2, LAYERS)  # the forward's first layer
        assert time.monotonic() - t0 < 5, "the engine waited on a dead daemon"
        tracker.wait_sync_pages(LAYERS, LAYERS)  # later layers do not wait again
        assert tracker.settle_sync_loads() is True
        assert tracker.take_load_errors() == set(dst)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert (s.array[dst] == 7).all(), "a dead daemon wrote into the engine"


def test_a_forward_that_did_not_wait_fails_its_layerwise_loads(make_node):
    """The copy succeeded, but the forward never waited for the last layer (vLLM's layer hooks
    did not run, e.g. FULL CUDA graphs): the blocks are recomputed, not trusted."""
    s = Setup(make_node())
    dst = [58, 59, 60, 61, 62, 63]
    tracker = TransferTracker()
    call = s.call(dst, 2)
    tracker.load_sent("req-2", call, dst, sync=True, answer_by=time.monotonic() + 10)
    tracker.wait_sync_pages(4, LAYERS)
    assert tracker.settle_sync_loads(forward_waited=False) is True
    assert tracker.take_load_errors() == set(dst)
    assert call.result(1).bytes == 6 * LAYERS * PAGE  # the copy itself went fine


def test_a_caller_that_cancels_its_stream_leaves_the_job_running(make_node):
    """The engine side gives up on a TransferLayers call (its deadline, a replaced channel): the
    job still finishes once, and the same plan asked for again joins its outcome."""
    s = Setup(make_node(**fault_env(GROUP_DELAY_SECS="0.4")))
    dst = [24, 25, 26, 27, 28, 29]
    s.array[dst] = 0
    stream = s.stub.TransferLayers(s.request(dst, 2), timeout=10)
    assert next(stream).pages_landed == 6  # the first group (front-loaded: 6 of 8 pages) landed ...
    stream.cancel()  # ... and the caller went away
    answer = s.stub.Transfer(s.request(dst, 0), timeout=10)
    assert answer.joined and answer.bytes == 6 * LAYERS * PAGE
    assert np.array_equal(s.array[dst], s.array[0:6])
    assert s.stub.Status(pb.WorkerStatusRequest(), timeout=5).counters["jobs_ok"] >= 1
    assert "Task was destroyed but it is pending" not in s.node.log_tails(chars=1 << 20)
