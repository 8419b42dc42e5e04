"""Bad requests get a precise gRPC status and change nothing.

To forge *signed* plans with out-of-range slots, the test plays the node's second worker:
it reads the node key (as the operator can: the 0600 file in the socket dir), attaches with
the daemon token and derives the leader's plan key, exactly as a worker does.
"""
from __future__ import annotations

import asyncio
import queue
import re
import threading
import time

import grpc
import numpy as np
import pytest

from kvbm_client import KvbmConfig, sequence_hashes
from kvbm_client.channels import open_channel
from kvbm_client.contract import pb, rpc, sign_plan
from kvbm_client.region_wire import RegionRefused, register
from kvbm_client.security import load_node_key

CODE = grpc.StatusCode


def hashes(n: int, seed: int = 0):
    return sequence_hashes([seed * 31 + i for i in range(n * 16)], 16)


class FakeWorker:
    """Attaches as worker '1' over the real Attach stream and plays its part by hand."""

    def __init__(self, address: str, config: KvbmConfig) -> None:
        key = load_node_key(config.resolved_node_key_file)
        self.channel = open_channel(address, config, daemon_token=key.daemon_token)
        self.stub = rpc.LeaderStub(self.channel)
        self.events: queue.Queue = queue.Queue()
        self.stream = self.stub.Attach(pb.AttachRequest(worker_id="1", rank=1, endpoint="unix:/nonexistent", pid=1))
        threading.Thread(target=self._pump, daemon=True).start()
        self.secret = key.plan_key(self.next_event("welcome").welcome.leader_id)

    def _pump(self) -> None:
        try:
            for event in self.stream:
                self.events.put(event)
        except grpc.RpcError:
            pass

    def next_event(self, kind: str, timeout: float = 10) -> "pb.LeaderEvent":
        end = time.monotonic() + timeout
        while True:
            event = self.events.get(timeout=max(0.01, end - time.monotonic()))
            if event.WhichOneof("event") == kind:
                return event

    def become_ready(self, layout: "pb.KvLayout") -> int:
        self.stub.SetLayout(pb.SetLayoutRequest(worker_id="1", layout=layout))
        plan = self.next_event("pools").pools
        self.stub.PoolsReady(pb.PoolsReadyRequest(worker_id="1", epoch=plan.epoch, ok=True))
        return plan.epoch

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


@pytest.fixture
def rig(make_node):
    node = make_node(num_workers=2, start=False, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="16",
                     DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="16", DYN_KVBM_MAX_HASHES_PER_REQUEST="64")
    node.start_leader()
    node.start_worker("0")
    node.wait_attached(1)
    fake = FakeWorker(node.leader_address, node.config())
    client = node.client()
    engine = node.engine(num_blocks=32, num_layers=2, page_bytes=4096)
    client.register_region("0", engine.spec())
    epoch = fake.become_ready(pb.KvLayout(num_layers=2, page_bytes=4096, dtype="uint8", num_engine_blocks=32, rank=1))
    client.wait_ready(30)
    worker_channel = grpc.insecure_channel(client.workers["0"].endpoint)
    yield node, fake, client, engine, rpc.WorkerStub(worker_channel), epoch
    worker_channel.close()
    fake.close()


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_worker_rejects_bad_transfers_and_moves_nothing(rig):
    node, fake, client, engine, worker, epoch = rig
    keys = hashes(4)
    store = client.prepare_store(keys)
    client.start(store, [0, 1, 2, 3], worker_ids=["0"])
    client.wait(store)  # worker 0 stored its shard (the fake worker never confirms: job stays pending)
    region = client.aio.regions["0"]
    snapshot = engine.array.copy()

    def plan(kind=2, tiers=(2,), slots=(0,), deadline_in=5.0, plan_epoch=None, secret=None):
        p = pb.TransferPlan(job_id=999, kind=kind, tiers=list(tiers), slots=list(slots),
                            deadline=time.monotonic() + deadline_in, epoch=epoch if plan_epoch is None else plan_epoch)
        return sign_plan(p, secret or fake.secret)

    def transfer(signed, blocks, region_id=region):
        return lambda: worker.Transfer(pb.TransferRequest(region_id=region_id, plan=signed, engine_blocks=blocks))

    assert _code(transfer(plan(), [5], region_id="region-nope")) == CODE.NOT_FOUND
    assert _code(transfer(plan(secret=b"x" * 32), [5])) == CODE.PERMISSION_DENIED
    tampered = plan()
    tampered.plan = tampered.plan[:-1] + bytes([tampered.plan[-1] ^ 1])
    assert _code(transfer(tampered, [5])) == CODE.PERMISSION_DENIED
    assert _code(transfer(plan(), [32])) == CODE.OUT_OF_RANGE  # engine block out of range
    assert _code(transfer(plan(slots=(16,)), [5])) == CODE.OUT_OF_RANGE  # G2 slot out of range
    assert _code(transfer(plan(tiers=(3,), slots=(99,)), [5])) == CODE.OUT_OF_RANGE  # G3 slot
    assert _code(transfer(plan(tiers=(1,), slots=(0,)), [5])) == CODE.OUT_OF_RANGE  # G1 is no pool tier
    assert _code(transfer(plan(plan_epoch=epoch + 7), [5])) == CODE.FAILED_PRECONDITION
    assert _code(transfer(plan(deadline_in=-1), [5])) == CODE.DEADLINE_EXCEEDED
    assert _code(transfer(plan(), [5, 6])) == CODE.INVALID_ARGUMENT  # sizes differ
    assert _code(transfer(plan(tiers=(2, 2), slots=(0, 1)), [5, 5])) == CODE.INVALID_ARGUMENT  # twice
    assert _code(transfer(plan(kind=3), [5])) == CODE.INVALID_ARGUMENT  # a command is no transfer
    assert np.array_equal(engine.array, snapshot), "a rejected request changed engine memory"
    # A well-formed plan the leader never issued moves nothing either (StartTransfer refuses it).
    assert _code(transfer(plan(tiers=(2,), slots=(0,)), [20])) == CODE.FAILED_PRECONDITION
    assert np.array_equal(engine.array, snapshot)
    # The stored shard is intact: the fake worker confirms its part, then a genuine load plan
    # brings block 0 back into engine block 20.
    fake.stub.CompleteTransfer(pb.CompleteTransferRequest(worker_id="1", job_id=store.job_id, ok=True))
    load = client.prepare_load(keys[:1])
    assert load.num_blocks == 1
    worker.Transfer(pb.TransferRequest(region_id=region, plan=load.signed, engine_blocks=[20]))
    assert np.array_equal(engine.array[20], snapshot[0])


def _refused(path: str, request: "pb.RegisterRegionRequest", fds=()) -> grpc.StatusCode:
    with pytest.raises(RegionRefused) as info:
        register(path, request, list(fds), 10).close()
    return info.value.code


def test_worker_rejects_bad_regions(rig, tmp_path):
    node, fake, client, engine, worker, epoch = rig
    spec = engine.spec()
    good, fds = spec.to_request(), spec.fds
    path = node.config().region_socket("0")
    with pytest.raises(grpc.RpcError) as info:  # never over gRPC
        worker.RegisterRegion(good)
    assert info.value.code() == CODE.FAILED_PRECONDITION and path in info.value.details()

    def bad(edit) -> "pb.RegisterRegionRequest":
        request = pb.RegisterRegionRequest()
        request.CopyFrom(good)
        edit(request)
        return request

    def claim_more(r):
        r.buffers[0].size_bytes *= 2  # claims more than the memfd has
    assert _refused(path, bad(claim_more), fds) == CODE.INVALID_ARGUMENT
    assert _refused(path, bad(lambda r: setattr(r, "num_blocks", 33)), fds) == CODE.INVALID_ARGUMENT  # past the end
    assert _refused(path, bad(lambda r: setattr(r.buffers[0], "shm_path", str(tmp_path / "kv"))), fds) \
        == CODE.INVALID_ARGUMENT  # a path is never opened
    assert _refused(path, bad(lambda r: setattr(r.buffers[0], "cuda_ipc_handle", b"\0" * 64))) \
        == CODE.INVALID_ARGUMENT  # a CPU worker opens no CUDA handle
    assert _refused(path, bad(lambda r: setattr(r.layers[1], "block_stride_bytes", 100)), fds) \
        == CODE.INVALID_ARGUMENT  # pages would overlap
    assert _refused(path, bad(lambda r: setattr(r.buffers[0], "fd_index", 1)), fds) == CODE.INVALID_ARGUMENT
    assert _refused(path, good) == CODE.INVALID_ARGUMENT  # the memfd did not come with it
    assert _refused(path, good, [fds[0], fds[0]]) == CODE.INVALID_ARGUMENT  # an fd no buffer names
    assert _code(lambda: worker.UnregisterRegion(pb.UnregisterRegionRequest(region_id="nope"))) == CODE.NOT_FOUND
    # After all that, a valid registration still works (a second region of one layout: served).
    lease = register(path, good, fds, 10)
    assert re.fullmatch(r"region-[0-9a-f]{32}", lease.region_id)
    lease.close()


def test_leader_rejects_bad_requests(rig):
    node, fake, client, engine, worker, epoch = rig
    leader = fake.stub
    session = client.aio.session_id
    assert _code(lambda: leader.CompleteTransfer(pb.CompleteTransferRequest(worker_id="7", job_id=1, ok=True))) \
        == CODE.NOT_FOUND
    assert _code(lambda: leader.SetLayout(pb.SetLayoutRequest(worker_id="7"))) == CODE.NOT_FOUND
    assert _code(lambda: leader.SetLayout(pb.SetLayoutRequest(worker_id="1"))) == CODE.INVALID_ARGUMENT
    dup = leader.Attach(pb.AttachRequest(worker_id="1", rank=1, endpoint="x"))
    assert _code(lambda: next(iter(dup))) == CODE.ALREADY_EXISTS
    stranger = leader.Attach(pb.AttachRequest(worker_id="9", rank=9, endpoint="x"))
    assert _code(lambda: next(iter(stranger))) == CODE.NOT_FOUND
    too_many = [bytes([i % 256]) * 8 for i in range(65)]
    assert _code(lambda: leader.Match(pb.MatchRequest(session_id=session, hashes=too_many))) == CODE.INVALID_ARGUMENT
    assert _code(lambda: leader.PrepareStore(pb.PrepareStoreRequest(session_id=session, hashes=too_many))) \
        == CODE.INVALID_ARGUMENT
    assert _code(lambda: leader.Match(pb.MatchRequest(session_id=session, hashes=[b"x" * 65]))) \
        == CODE.INVALID_ARGUMENT
    assert _code(lambda: leader.Match(pb.MatchRequest(session_id=session, hashes=[b""]))) == CODE.INVALID_ARGUMENT
    assert _code(lambda: leader.PrepareStore(pb.PrepareStoreRequest(
        session_id=session, hashes=[b"a" * 8, b"b" * 8], parent_hashes=[b"c" * 8]))) == CODE.INVALID_ARGUMENT
    assert _code(lambda: leader.Match(pb.MatchRequest(session_id="nope", hashes=[b"a" * 8]))) == CODE.NOT_FOUND
    assert _code(lambda: leader.Release(pb.ReleaseRequest(session_id=session, job_id=12345))) == CODE.NOT_FOUND
    # Nothing was stored by any of it.
    assert node.status().tiers[0].used_blocks == 0


def test_requests_after_shutdown_began_are_unavailable(tmp_path):
    from kvbm_leader.daemon import LeaderDaemon

    async def scenario() -> grpc.StatusCode:
        config = KvbmConfig.from_env({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "4",
                                      "DYN_KVBM_SOCKET_DIR": str(tmp_path)})
        daemon = LeaderDaemon(config, ["0"])
        await daemon.start()
        try:
            async with grpc.aio.insecure_channel(daemon.address) as channel:
                stub = rpc.LeaderStub(channel)
                await stub.OpenSession(pb.OpenSessionRequest(client_name="t"))
                daemon.service.closing = True  # what close() does first
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.OpenSession(pb.OpenSessionRequest(client_name="t"))
                return info.value.code()
        finally:
            await daemon.close()
            await daemon.close()  # idempotent

    assert asyncio.run(scenario()) == CODE.UNAVAILABLE
