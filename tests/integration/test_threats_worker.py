"""The worker's half of the trust boundary (issue "Trust boundary and integrity"), one test per
row of its table, tried as a hostile or unlucky client would: real daemons, requests through
the generated stubs, and each time: the engine's bytes unchanged, the worker alive, a precise
status. Faults that only a broken disk produces come from tests/support/faults (put on the
worker's PYTHONPATH), never from the production worker.
"""
from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvbm_client import AsyncKvbmClient, KvbmError, KvbmTimeoutError, Tier, sequence_hashes
from kvbm_client.bus import commands_subject
from kvbm_client.config import OPTIONS
from kvbm_client.contract import pb, sign_plan
from kvbm_client.region_wire import RegionRefused, register
from kvbm_client.security import ack_is_authentic, load_node_key
from kvbm_client.sizing import slot_bytes
from support.fault_env import fault_env
from support.probes import code_of, worker_stub

CODE = grpc.StatusCode


def hashes(n: int, seed: int = 0):
    return sequence_hashes([seed * 7_777 + i for i in range(n * 16)], 16)


def worker_counters(node) -> dict[str, float]:
    return dict(worker_stub(node).Status(pb.WorkerStatusRequest(), timeout=5).counters)


def transfer(node, client, handle, blocks):
    request = pb.TransferRequest(region_id=client.regions["0"], plan=handle.signed, engine_blocks=list(blocks))
    return lambda: worker_stub(node).Transfer(request, timeout=30)


async def stored(node, keys) -> AsyncKvbmClient:
    """An async client of ``node`` with an engine registered and ``keys`` stored from its first blocks."""
    client = await AsyncKvbmClient.connect(node.config())
    engine = node.engine(num_blocks=64)
    await client.register_region("0", engine.spec())
    await client.wait_ready(30)
    await client.wait(await client.offload(keys, list(range(len(keys)))))
    return client


# ---------------------------------------------------------------------------- row 1
@pytest.mark.parametrize("block", [2**64 - 1, 2**63, 64])
def test_row1_engine_block_ids_are_unsigned(make_node, block):
    node = make_node()
    client, engines = node.ready_client()
    keys = hashes(1)
    client.wait(client.offload(keys, [0]))
    engines["0"].array[1:] = 7
    before = engines["0"].array.copy()
    load = client.prepare_load(keys)  # a genuine plan; only the engine block is hostile
    assert code_of(transfer(node, client, load, [block])) == CODE.OUT_OF_RANGE
    assert np.array_equal(engines["0"].array, before), "a hostile engine block id moved bytes"
    transfer(node, client, load, [40])()  # the worker is alive and the plan still good
    assert np.array_equal(engines["0"].array[40], before[0])


# ---------------------------------------------------------------------------- rows 2 and 3
def test_row2_a_released_plan_replayed_after_its_slot_was_reused_moves_nothing(make_node):
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="4")
    client, engines = node.ready_client()
    eng = engines["0"].array
    victim = hashes(1, seed=1)
    client.wait(client.offload(victim, [0]))
    stale = client.prepare_load(victim)
    client.release(stale)
    client.wait(client.offload(hashes(4, seed=2), [1, 2, 3, 4]))  # G2 full: the victim's slot is reused
    assert client.match(victim, count_hit=False).num_matched == 0
    eng[10] = 0
    before = eng.copy()
    assert code_of(transfer(node, client, stale, [10])) == CODE.FAILED_PRECONDITION
    assert np.array_equal(eng, before), "a replayed plan delivered another block's bytes"
    assert "did not let it start" in (node.root / "worker-0.log").read_text()


def test_row3_queued_loads_never_start_after_their_deadline(make_node):
    node = make_node(DYN_KVBM_JOB_TIMEOUT_SECS="1", DYN_KVBM_MAX_QUEUED_JOBS="1000",
                     **fault_env(COPY_DELAY_SECS="0.02"))
    n, keys = 600, hashes(2, seed=3)

    async def scenario() -> list[object]:
        client = await stored(node, keys)
        try:
            handles = await asyncio.gather(*(client.onboard(keys, [2 + i % 60, 3 + i % 60]) for i in range(n)))
            return await asyncio.gather(*(client.wait(h) for h in handles), return_exceptions=True)
        finally:
            await client.close()

    results = asyncio.run(scenario())
    done = sum(1 for r in results if not isinstance(r, BaseException))
    late = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(r, KvbmTimeoutError) and "job " in str(r) for r in late), late[:3]  # the daemons' word
    counters = worker_counters(node)
    assert counters["jobs_late"] > 0, "the lanes never backed up: nothing was tested"
    log = (node.root / "worker-0.log").read_text()
    starts = [float(m) for m in re.findall(r"job \d+ load: copy starts (-?[\d.]+) ms before its deadline", log)]
    # every copy that ran (the offload is one job); a copy still running at its deadline stops (jobs_expired)
    assert len(starts) == done + counters["jobs_expired"] and done == counters["jobs_ok"] - 1
    assert min(starts) > 0, "a copy started after its deadline"
    assert done + len(late) == n


def test_row3_lane_queues_are_bounded(make_node):
    node = make_node(DYN_KVBM_MAX_QUEUED_JOBS="2", **fault_env(COPY_DELAY_SECS="0.3"))
    keys = hashes(1, seed=4)

    async def scenario() -> tuple[list[object], object]:
        client = await stored(node, keys)
        try:
            handles = await asyncio.gather(*(client.onboard(keys, [10 + i]) for i in range(8)))
            results = await asyncio.gather(*(client.wait(h) for h in handles), return_exceptions=True)
            after = await client.wait(await client.onboard(keys, [30]))  # the worker still serves
            return results, after
        finally:
            await client.close()

    results, after = asyncio.run(scenario())
    busy = [r for r in results if isinstance(r, KvbmError) and getattr(r, "code", None) == CODE.RESOURCE_EXHAUSTED]
    assert busy and all("DYN_KVBM_MAX_QUEUED_JOBS" in str(r) for r in busy)
    assert sum(1 for r in results if not isinstance(r, BaseException)) >= 2
    assert after.num_blocks == 1
    assert worker_counters(node)["jobs_refused_busy"] == len(busy)


# ---------------------------------------------------------------------------- row 4
def test_row4_slots_are_rounded_by_the_one_rule(make_node):
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="", DYN_KVBM_CPU_CACHE_GB="0.001")
    client, _ = node.ready_client(num_blocks=8, num_layers=3, page_bytes=1000)  # 3000-byte blocks
    info = worker_stub(node).Status(pb.WorkerStatusRequest(), timeout=5).info
    capacity = next(t for t in node.status().tiers if t.tier == Tier.HOST).capacity_blocks
    assert capacity == int(1e6 // slot_bytes(3000)) == 244
    assert info.host_bytes == capacity * 4096 <= 1e6, "the worker allocated more than DYN_KVBM_CPU_CACHE_GB"


# ---------------------------------------------------------------------------- row 10
def g3_node(make_node, **env):
    node = make_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="16", **env)
    client, engines = node.ready_client()
    return node, client, engines["0"].array


def slot_of(node, eng, block: int) -> int:
    """The G3 slot holding engine block ``block`` (found by its bytes in the file)."""
    status = worker_stub(node).Status(pb.WorkerStatusRequest(), timeout=5)
    data = np.fromfile(status.disk_path, np.uint8)
    stride = slot_bytes(eng[block].size)
    rows = data[: len(data) // stride * stride].reshape(-1, stride)[:, : eng[block].size]
    hits = np.flatnonzero((rows == eng[block].ravel()).all(axis=1))
    assert len(hits) == 1
    return int(hits[0])


def overwrite(node, offset: int, data: bytes) -> None:
    path = worker_stub(node).Status(pb.WorkerStatusRequest(), timeout=5).disk_path
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def test_row10_overwritten_g3_bytes_fail_the_load_cleanly(make_node):
    node, client, eng = g3_node(make_node)
    keys = hashes(2, seed=5)
    client.wait(client.offload(keys, [0, 1]))
    slot = slot_of(node, eng, 1)
    overwrite(node, slot * slot_bytes(eng[1].size) + 100, b"\x00\x01\x02\x03")
    before = eng.copy()
    load = client.prepare_load(keys)
    with pytest.raises(grpc.RpcError) as info:
        transfer(node, client, load, [20, 21])()
    assert info.value.code() == CODE.DATA_LOSS and "checksum mismatch" in info.value.details()
    assert np.array_equal(eng, before), "bytes that failed verification reached the engine"
    counters = worker_counters(node)
    assert counters["corrupt_disk_slots"] == 1
    client.wait(client.onboard(keys[:1], [30]))  # the good block still loads: the worker is alive
    assert np.array_equal(eng[30], before[0])


def test_row10_a_corrupt_block_is_not_matched_again(make_node):
    node, client, eng = g3_node(make_node)
    keys = hashes(1, seed=6)
    client.wait(client.offload(keys, [0]))
    overwrite(node, slot_of(node, eng, 0) * slot_bytes(eng[0].size) + 5, b"\xee")
    with pytest.raises(KvbmError):
        client.wait(client.onboard(keys, [20]))
    deadline = time.monotonic() + 5
    while client.match(keys, count_hit=False).num_matched and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.match(keys, count_hit=False).num_matched == 0
    assert node.status().counters["kvbm_corrupt_blocks"] == 1


def test_row10_a_truncated_g3_file_fails_the_load_cleanly(make_node):
    node, client, eng = g3_node(make_node)
    keys = hashes(2, seed=7)
    client.wait(client.offload(keys, [0, 1]))
    stride = slot_bytes(eng[0].size)
    cut = max(slot_of(node, eng, 0), slot_of(node, eng, 1))
    before = eng.copy()
    os.truncate(worker_stub(node).Status(pb.WorkerStatusRequest(), timeout=5).disk_path, cut * stride)
    load = client.prepare_load(keys)
    assert code_of(transfer(node, client, load, [20, 21])) == CODE.DATA_LOSS
    assert np.array_equal(eng, before)
    assert worker_counters(node)["corrupt_disk_slots"] >= 1
    intact = 0 if slot_of(node, eng, 0) < cut else 1
    client.wait(client.onboard(keys[intact:intact + 1], [30]))  # the block before the cut still loads
    assert np.array_equal(eng[30], before[intact])


def test_row10_a_hung_disk_fails_the_job_and_the_next_is_answered(make_node):
    node, client, eng = g3_node(make_node, DYN_KVBM_DISK_IO_TIMEOUT_SECS="1",
                                **fault_env(DISK_HANG_READ_SECS="8"))
    keys = hashes(2, seed=9)
    client.wait(client.offload(keys, [0, 1]))  # writes: the fault hangs reads only
    before = eng.copy()
    first = client.prepare_load(keys[:1])
    second = client.prepare_load(keys[1:])
    start = time.monotonic()
    assert code_of(transfer(node, client, first, [20])) == CODE.DATA_LOSS  # could not be read in time
    assert time.monotonic() - start < 5, "the job waited for the hung disk"
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        transfer(node, client, second, [21])()
    assert info.value.code() == CODE.ABORTED and "has not returned" in info.value.details()
    assert time.monotonic() - start < 2, "the next disk job queued behind the hung one"
    assert np.array_equal(eng, before)
    log = node.root / "worker-0.log"
    deadline = time.monotonic() + 15
    while "the disk is used again" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    client.wait(client.onboard(keys[1:], [22]))  # the disk came back: loads work again
    assert np.array_equal(eng[22], before[1])
    assert "kvbm_faults: patched kvbm_worker.handlers.disk" in log.read_text()


def test_row10_disk_errors_fail_stores_cleanly(make_node):
    node, client, eng = g3_node(make_node, **fault_env(DISK_EIO_AFTER="0"))
    keys = hashes(2, seed=10)
    with pytest.raises(KvbmError, match="EIO"):
        client.wait(client.offload(keys, [0, 1]))
    assert client.match(keys, count_hit=False).num_matched == 0, "a block that never reached disk is matchable"
    assert worker_stub(node).Status(pb.WorkerStatusRequest(), timeout=5).info.state == "ready"


# ---------------------------------------------------------------------------- row 11
def test_row11_region_limits_are_checked_before_anything_is_mapped(make_node):
    node = make_node(DYN_KVBM_MAX_REGION_PAGES="8192")
    path = node.config().region_socket("0")
    engine = node.engine(num_blocks=1, num_layers=1, page_bytes=4096)

    def region(layers: int = 1, buffers: int = 1, engine_id: str = "e"):
        return pb.RegisterRegionRequest(
            engine_id=engine_id, page_bytes=64, num_blocks=1, dtype="uint8",
            buffers=[pb.RegionBuffer(fd_index=0, size_bytes=4096, device=-1) for _ in range(buffers)],
            layers=[pb.LayerPlacement(buffer_index=0, offset_bytes=0, block_stride_bytes=64)] * layers)

    for req, setting in ((region(layers=50_002), "DYN_KVBM_MAX_REGION_PAGES"),
                         (region(buffers=65), "DYN_KVBM_MAX_REGION_BUFFERS"),
                         (region(engine_id="x" * 257), "DYN_KVBM_MAX_NAME_BYTES")):
        with pytest.raises(RegionRefused) as info:
            register(path, req, [engine.fd], 10)
        assert info.value.code == CODE.INVALID_ARGUMENT and setting in str(info.value)
    with pytest.raises(RegionRefused, match="DYN_KVBM_MAX_REGION_BUFFERS"):  # more fds than buffers (+ a signal page)
        register(path, region(), [engine.fd] * 66, 10)
    with pytest.raises(RegionRefused, match="buffers name only"):  # one more fd than buffers, and no signal page
        register(path, region(), [engine.fd] * 65, 10)
    lease = register(path, region(layers=4), [engine.fd], 10)  # within the limits: served
    assert lease.region_id
    lease.close()


# ---------------------------------------------------------------------------- row 12
@pytest.fixture
def nats_server(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
    from cluster_support import NatsServer, binary
    if binary("nats-server") is None:
        pytest.skip("nats-server is not installed (tests/cluster/install_services.sh installs it)")
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop(kill=True)


def test_row12_nats_command_refusals_are_signed_by_the_worker(make_node, nats_server):
    node = make_node(NATS_SERVER=nats_server.url, DYN_KVBM_NODE_NAME="n1")
    node.ready_client()
    key = load_node_key(node.config().resolved_node_key_file)
    leader_id = node.status().leader_id

    def command(secret: bytes, job_id: int) -> bytes:
        plan = pb.TransferPlan(job_id=job_id, kind=4, promote_host_slots=[0], promote_disk_slots=[0],
                               deadline=time.monotonic() + 60, epoch=999, leader_id=leader_id)
        return pb.CommandRequest(plan=sign_plan(plan, secret)).SerializeToString()

    async def ask(data: bytes) -> "pb.CommandResponse":
        import nats
        nc = await nats.connect(nats_server.url)
        try:
            msg = await nc.request(commands_subject("n1", "0"), data, timeout=10)
        finally:
            await nc.close()
        resp = pb.CommandResponse()
        resp.ParseFromString(msg.data)
        return resp

    refused = asyncio.run(ask(command(key.plan_key(leader_id), 77)))
    assert not refused.ok and refused.error.startswith("FAILED_PRECONDITION")
    assert ack_is_authentic(key, refused, "0", 77), "the worker's refusal is not verifiable"
    forged = asyncio.run(ask(command(b"y" * 32, 78)))
    assert not forged.ok and not ack_is_authentic(key, forged, "0", 78)
    assert worker_stub(node).Status(pb.WorkerStatusRequest(), timeout=5).info.state == "ready"


def test_the_production_worker_reads_no_fault_variables():
    root = Path(__file__).resolve().parents[2] / "kvbm_worker"
    assert [str(p) for p in root.rglob("*.py") if "KVBM_FAULT" in p.read_text()] == []
    assert not any("KVBM_FAULT" in o.env for o in OPTIONS)
