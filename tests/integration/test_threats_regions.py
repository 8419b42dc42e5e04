"""Regions a client may map (issue "Trust boundary and integrity", rows 6 and 7) and several
engines sharing one worker's cache (issue "disaggregated ... one cache", part 2).

Real daemons; engines are this process or stand-in engine processes
(``tests/support/region_engine.py``) that register over the worker's region socket. Each
hostile attempt is answered with a precise status, moves no byte, and leaves the worker alive.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvbm_client import KvbmClient, KvbmError, ShmKvBuffer, sequence_hashes
from kvbm_client.contract import pb
from kvbm_client.region_wire import RegionRefused, register
from kvbm_client.security import region_digest
from support.probes import code_of, wait_for, worker_stub

CODE = grpc.StatusCode
ENGINE = Path(__file__).resolve().parents[1] / "support" / "region_engine.py"
LAYERS, PAGE = 4, 2048  # as region_engine.py


def keys(n: int, seed: int) -> list:
    return sequence_hashes([seed * 7_919 + i for i in range(n * 16)], 16)


def refusal(node, request: "pb.RegisterRegionRequest", fds=()) -> RegionRefused:
    with pytest.raises(RegionRefused) as info:
        register(node.config().region_socket("0"), request, list(fds), 10).close()
    return info.value


class EngineProcess:
    """A stand-in engine (another process) holding a region on worker 0."""

    def __init__(self, node, *args: str) -> None:
        log = open(node.root / f"engine-{len(list(node.root.glob('engine-*')))}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, str(ENGINE), *args], env=node.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log)
        line = self.proc.stdout.readline()
        assert line, f"the engine process exited ({self.proc.wait()}); see {log.name}"
        self.info = json.loads(line)
        self.pid = self.info["pid"]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


@pytest.fixture
def engines():
    procs: list[EngineProcess] = []
    yield procs
    for p in procs:
        if p.proc.poll() is None:
            p.kill()


def regions_of(node) -> list:
    return list(node.worker_status("0").regions)


def worker_pid(node) -> int:
    return node.workers[next(iter(node.workers))].pid


# ---------------------------------------------------------------------------- row 6
def test_row6_a_registration_naming_a_path_is_refused(make_node, tmp_path):
    node = make_node()
    secret = tmp_path / "root-only"
    secret.write_bytes(secrets.token_bytes(4096))
    secret.chmod(0o600)
    before = secret.read_bytes()
    request = pb.RegisterRegionRequest(engine_id="thief", page_bytes=4096, num_blocks=1, dtype="uint8",
                                       buffers=[pb.RegionBuffer(shm_path=str(secret), size_bytes=4096, device=-1)],
                                       layers=[pb.LayerPlacement(buffer_index=0, block_stride_bytes=4096)])
    worker = worker_stub(node)
    with pytest.raises(grpc.RpcError) as info:
        worker.RegisterRegion(request, timeout=10)
    assert info.value.code() == CODE.FAILED_PRECONDITION
    path = node.config().region_socket("0")
    assert path in info.value.details()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "the region socket is not 0600"
    refused = refusal(node, request)  # the same over the region socket: a path is never opened
    assert refused.code == CODE.INVALID_ARGUMENT and "shm_path" in str(refused)
    request.buffers[0].ClearField("shm_path")
    request.buffers[0].fd_index = 0
    with open(secret, "r+b") as f:  # even its fd: a regular file is not a sealed memfd
        refused = refusal(node, request, [f.fileno()])
    assert refused.code == CODE.INVALID_ARGUMENT and "regular file" in str(refused)
    assert regions_of(node) == [], "a region was registered"
    assert secret.read_bytes() == before
    assert worker.Status(pb.WorkerStatusRequest(), timeout=5).info.worker_id == "0"


def test_row6_the_owner_is_the_peer_and_a_claimed_pid_takes_nothing(make_node, engines):
    node = make_node()
    client, eng = node.ready_client()  # the engine: this process
    mine = client.region_id("0")
    squatter = EngineProcess(node, "squat", "--claim-pid", str(os.getpid()))  # says it is us
    engines.append(squatter)
    owners = {r.digest: r.pid for r in regions_of(node)}
    assert owners == {region_digest(mine): os.getpid(), squatter.info["digest"]: squatter.pid}, \
        "a region's owner came from the request, not from the socket's peer"
    # Our region kept working beside it, and re-registering ours is not blocked by the claim.
    k = keys(2, 1)
    client.wait(client.offload(k, [0, 1]))
    client.unregister_region("0")
    client.register_region("0", eng["0"].spec())
    eng["0"].array[10:12] = 0
    client.wait(client.onboard(k, [10, 11]))
    assert np.array_equal(eng["0"].array[10:12], eng["0"].array[0:2])
    squatter.kill()  # its region ends with its connection; ours stays
    wait_for(lambda: len(regions_of(node)) == 1, "the squatter's region to go")
    assert regions_of(node)[0].pid == os.getpid()


def test_row6_someone_elses_region_cannot_be_unregistered_or_transferred_into(make_node, engines):
    node = make_node()
    victim = EngineProcess(node, "engine", "--store", "2", "--seed", "3")
    engines.append(victim)
    status = node.worker_status("0")
    assert status.region_id == "", "Status shows a region id (a capability)"
    assert [r.digest for r in status.regions] == [victim.info["digest"]]
    assert re.fullmatch(r"region-[0-9a-f]{32}", victim.info["region_id"]), "a region id is not 128 random bits"
    # The attacker: its own region, a genuine load plan of the victim's blocks.
    client, eng = node.ready_client()
    load = client.prepare_load(keys(2, 3))
    assert load.num_blocks == 2
    worker = worker_stub(node)
    for guess in (victim.info["digest"], "region-" + secrets.token_hex(16), ""):
        assert code_of(lambda: worker.UnregisterRegion(pb.UnregisterRegionRequest(region_id=guess), timeout=5)) \
            == CODE.NOT_FOUND
        assert code_of(lambda: worker.Transfer(pb.TransferRequest(region_id=guess, plan=load.signed,
                                                                  engine_blocks=[0, 1]), timeout=10)) \
            == CODE.NOT_FOUND
    assert [r.digest for r in regions_of(node) if r.pid == victim.pid] == [victim.info["digest"]]
    assert victim.proc.poll() is None
    client.wait(client.onboard(keys(2, 3), [5, 6]))  # into its own region: fine
    assert np.array_equal(eng["0"].array[5:7], np.random.default_rng(3).integers(
        0, 256, (32, LAYERS, PAGE), dtype=np.uint8)[0:2])


# ---------------------------------------------------------------------------- row 7
def _memfd(size: int, flags: int = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING, seals: int = 0) -> int:
    fd = os.memfd_create("kv", flags)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_row7_only_memfds_sealed_against_shrinking_are_mapped(make_node, tmp_path):
    node = make_node()
    eng = ShmKvBuffer(8, LAYERS, PAGE)
    request = eng.spec().to_request()
    shm = tmp_path / "kv"
    shm.write_bytes(b"\0" * eng.nbytes)
    unsealed = _memfd(eng.nbytes)
    unsealable = _memfd(eng.nbytes, os.MFD_CLOEXEC)  # without MFD_ALLOW_SEALING
    grow_only = _memfd(eng.nbytes, seals=fcntl.F_SEAL_GROW)
    read, write = os.pipe()
    try:
        with open(shm, "r+b") as f:
            cases = [(unsealed, "not sealed against shrinking"), (unsealable, "not sealed against shrinking"),
                     (grow_only, "not sealed against shrinking"), (f.fileno(), "regular file"),
                     (read, "not a memory file")]
            for fd, why in cases:
                refused = refusal(node, request, [fd])
                assert refused.code == CODE.INVALID_ARGUMENT and why in str(refused), str(refused)
    finally:
        for fd in (unsealed, unsealable, grow_only, read, write):
            os.close(fd)
    assert regions_of(node) == []
    lease = register(node.config().region_socket("0"), request, eng.spec().fds, 10)  # sealed: served
    assert len(regions_of(node)) == 1
    lease.close()
    eng.close()


def test_row7_a_sealed_region_cannot_be_truncated_and_the_worker_stays_alive(make_node):
    node = make_node()
    client, eng = node.ready_client()
    pid = worker_pid(node)
    engine = eng["0"]
    k = keys(4, 7)
    client.wait(client.offload(k, [0, 1, 2, 3]))
    with pytest.raises(PermissionError):
        os.ftruncate(engine.fd, 0)
    fd = os.open(f"/proc/self/fd/{engine.fd}", os.O_RDWR)  # a second open file of the memfd: same seals
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
    finally:
        os.close(fd)
    assert os.fstat(engine.fd).st_size == engine.nbytes
    engine.array[40:44] = 0
    client.wait(client.onboard(k, [40, 41, 42, 43]))
    assert np.array_equal(engine.array[40:44], engine.array[0:4])
    assert worker_pid(node) == pid and node.workers[next(iter(node.workers))].running


def test_row7_an_engine_that_dies_loses_its_region_and_the_worker_serves_the_other(make_node, engines):
    node = make_node()
    dying = EngineProcess(node, "engine", "--store", "2", "--seed", "5")
    engines.append(dying)
    client, eng = node.ready_client()
    assert len(regions_of(node)) == 2
    dying.kill()  # SIGKILL: no unregister; the kernel closes its region socket
    wait_for(lambda: [r.pid for r in regions_of(node)] == [os.getpid()], "the dead engine's region to go", 5.0)
    pid = worker_pid(node)
    client.wait(client.onboard(keys(2, 5), [9, 10]))  # the dead engine's blocks, into ours
    assert np.array_equal(eng["0"].array[9:11], np.random.default_rng(5).integers(
        0, 256, (32, LAYERS, PAGE), dtype=np.uint8)[0:2])
    client.wait(client.offload(keys(1, 6), [3]))
    assert worker_pid(node) == pid


def test_a_closed_client_ends_its_region(make_node):
    node = make_node()
    client, _ = node.ready_client()
    assert len(regions_of(node)) == 1
    client.close()
    wait_for(lambda: regions_of(node) == [], "the region of a closed client to go", 5.0)


# ---------------------------------------------------------------------------- several engines
def test_two_engines_share_one_worker_and_its_blocks(make_node):
    node = make_node()
    a, b = KvbmClient(node.config(), client_name="engine-a"), KvbmClient(node.config(), client_name="engine-b")
    node.clients += [a, b]
    ea, eb = node.engine(num_blocks=48, seed=1), node.engine(num_blocks=20, seed=2)  # num_blocks may differ
    a.register_region("0", ea.spec())
    b.register_region("0", eb.spec())
    a.wait_ready(30)
    assert sorted(r.num_blocks for r in regions_of(node)) == [20, 48]
    k = keys(6, 11)
    a.wait(a.offload(k, [40, 41, 42, 43, 44, 45]))
    before_a = ea.array.copy()
    eb.array[10:16] = 0
    assert b.match(k).num_matched == 6, "engine B does not see engine A's blocks"
    b.wait(b.onboard(k, [10, 11, 12, 13, 14, 15]))
    assert np.array_equal(eb.array[10:16], ea.array[40:46]), "B's blocks are not A's bytes"
    assert np.array_equal(ea.array, before_a), "a load for B touched A's memory"
    with pytest.raises(KvbmError):  # B's blocks are named in B's region: 40 is past its end
        b.wait(b.onboard(k[:1], [40]))
    assert np.array_equal(ea.array, before_a)


def test_a_region_of_another_layout_is_refused_with_the_numbers(make_node):
    node = make_node()
    client, _ = node.ready_client(num_layers=4, page_bytes=2048)
    other = node.engine(num_blocks=8, num_layers=2, page_bytes=4096)
    refused = refusal(node, other.spec().to_request(), other.spec().fds)
    assert refused.code == CODE.FAILED_PRECONDITION
    assert "2 layers x 4096 bytes" in str(refused) and "4 layers x 2048 bytes" in str(refused)
    assert len(regions_of(node)) == 1
    client.unregister_region("0")  # no region held: a new layout is accepted (the pools follow)
    client.register_region("0", other.spec())
    client.wait_ready(30)
    assert node.worker_status("0").info.layout.page_bytes == 4096


def test_more_regions_than_the_setting_are_refused(make_node):
    node = make_node(DYN_KVBM_MAX_REGIONS="2")
    node.ready_client()
    spec = node.engine(num_blocks=8).spec()
    lease = register(node.config().region_socket("0"), spec.to_request(), spec.fds, 10)
    refused = refusal(node, spec.to_request(), spec.fds)
    assert refused.code == CODE.RESOURCE_EXHAUSTED and "DYN_KVBM_MAX_REGIONS" in str(refused)
    lease.close()
    wait_for(lambda: len(regions_of(node)) == 1, "the second region to go")
    register(node.config().region_socket("0"), spec.to_request(), spec.fds, 10).close()  # room again
