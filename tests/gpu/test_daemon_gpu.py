"""The real daemons with ``--gpu 0``: the engine (this process) exports its KV cache through CUDA
IPC; offload, overwrite, onboard into other blocks (G2, and G3 in disk-only mode), bytes equal."""
from __future__ import annotations

import os

import grpc
import pytest

from gpu_support import cuda_ready

if cuda_ready():
    pytest.skip(cuda_ready(), allow_module_level=True)

import torch  # noqa: E402

from gpu_kv import block_bytes, block_dim, fill_random, make_kv  # noqa: E402
from kvbm_client import Tier  # noqa: E402
from kvbm_client.cuda_export import export_kv_cache  # noqa: E402

NUM_BLOCKS, LAYERS = 96, 4


def keys(n: int, seed: int) -> list[bytes]:
    return [bytes([seed]) + os.urandom(15) for _ in range(n)]


def roundtrip(node, layout_from: str, layout_to: str, tier: Tier) -> None:
    client = node.client()
    kv = make_kv(layout_from, NUM_BLOCKS, LAYERS)
    fill_random(kv, 1)
    client.register_region("0", export_kv_cache(kv, block_dim=block_dim(layout_from)))
    client.wait_ready(60)
    hs, src = keys(40, 1), list(range(3, 43))
    ref = [block_bytes(kv, layout_from, b).clone() for b in src]
    res = client.wait(client.offload(hs, src))
    assert res.num_blocks == 40, node.log()[-3000:]
    assert client.match(hs).tiers == (tier,) * 40
    if layout_to != layout_from:
        client.unregister_region("0")
        kv = make_kv(layout_to, NUM_BLOCKS, LAYERS)
        client.register_region("0", export_kv_cache(kv, block_dim=block_dim(layout_to)))
        client.wait_ready(60)
    fill_random(kv, 2)  # the engine reuses its memory
    dst = list(range(50, 90))
    client.wait(client.onboard(hs, dst))
    for d, r in zip(dst, ref):
        assert torch.equal(block_bytes(kv, layout_to, d), r), f"block {d} onboarded wrong bytes"
    client.unregister_region("0")


def staged_load(node, client, hs: list[bytes], dst: list[int], **binding):
    """Look ``hs`` up, stage the plan (``Transfer`` with ``stage``, 3 layer groups), then bind it
    to ``dst`` (``TransferLayers``, with ``binding``'s fields); the stage's answer, the binding
    call's messages and the worker's counters after it."""
    from kvbm_client.channels import open_channel
    from kvbm_client.contract import pb, rpc
    from kvbm_client.leader_session import LeaderSession
    with LeaderSession(node.leader_address, timeout=5) as session:
        load = session.prepare_load(hs)
        stub = rpc.WorkerStub(open_channel(node.config().worker_address("0"), node.config()))
        signed = pb.SignedPlan(plan=load.signed.plan, signature=load.signed.signature)
        region = client.region_id("0")
        staged = stub.Transfer(pb.TransferRequest(region_id=region, layer_groups=3, plan=signed, stage=True),
                               timeout=30)
        request = pb.TransferRequest(region_id=region, engine_blocks=dst, layer_groups=3, plan=signed, **binding)
        messages = list(stub.TransferLayers(request, timeout=30))
        counters = stub.Status(pb.WorkerStatusRequest(), timeout=5).counters
    return staged, messages, counters


@pytest.mark.parametrize("layouts", [("cross", "cross"), ("layers", "layers"), ("cross", "layers")])
def test_g2_roundtrip_through_ipc(gpu_node, layouts):
    node = gpu_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="64")
    roundtrip(node, *layouts, Tier.HOST)


@pytest.mark.parametrize("mechanism", ["runs", "gather", "batch", "direct"])
def test_g2_roundtrip_forced_mechanism(gpu_node, mechanism):
    node = gpu_node("--cuda-copy", mechanism, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="64")
    roundtrip(node, "layers", "layers", Tier.HOST)


def test_disk_only_g1_g3_roundtrip(gpu_node):
    # 64 disk slots: bounce buffers of 32 + 32 rows, so 40 blocks take two pipelined chunks
    node = gpu_node(DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="64")
    roundtrip(node, "layers", "layers", Tier.DISK)


def test_layerwise_load_through_ipc(gpu_node):
    """TransferLayers on a CUDA region: the daemon copies a G2 load in 3 page groups, streams
    each group's end, and every block's bytes are equal at the end."""
    from kvbm_client.channels import open_channel
    from kvbm_client.contract import pb, rpc
    from kvbm_client.leader_session import LeaderSession
    node = gpu_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="64")
    client = node.client()
    kv = make_kv("cross", NUM_BLOCKS, LAYERS)
    fill_random(kv, 1)
    client.register_region("0", export_kv_cache(kv, block_dim=0))
    client.wait_ready(60)
    hs, src = keys(40, 3), list(range(3, 43))
    ref = [block_bytes(kv, "cross", b).clone() for b in src]
    client.wait(client.offload(hs, src))
    fill_random(kv, 2)
    with LeaderSession(node.leader_address, timeout=5) as session:
        load = session.prepare_load(hs)
        assert load.num_blocks == 40
        stub = rpc.WorkerStub(open_channel(node.config().worker_address("0"), node.config()))
        dst = list(range(50, 90))
        request = pb.TransferRequest(region_id=client.region_id("0"), engine_blocks=dst, layer_groups=3,
                                     plan=pb.SignedPlan(plan=load.signed.plan, signature=load.signed.signature))
        messages = list(stub.TransferLayers(request, timeout=30))
    pages = 2 * LAYERS  # K and V of each layer
    landed = [m.pages_landed for m in messages]
    assert landed == sorted(landed) and landed[-1] == pages and messages[-1].HasField("done"), landed
    from kvbm_worker.grouping import GroupPacing
    assert set(landed) <= set(GroupPacing().bounds(pages, 3)), "the ends of the daemon's default groups"
    for d, r in zip(dst, ref):
        assert torch.equal(block_bytes(kv, "cross", d), r), f"block {d} onboarded wrong bytes"
    client.unregister_region("0")


@pytest.mark.parametrize("layout", ["cross", "layers"])
@pytest.mark.parametrize("area", ["first", "all"])
def test_a_staged_load_through_ipc(gpu_node, layout, area):
    """A load staged before its blocks are named (``--stage-mib``): its first layer group copied
    into the worker's GPU staging area (only that group even where the area holds every group:
    ``stages.MAX_STAGED_GROUPS``), then scattered into the engine's blocks by index_copy_
    kernels once a TransferLayers call names them, the other groups copied straight; bytes equal."""
    from kvbm_worker.grouping import GroupPacing
    pages, page_bytes, n = 2 * LAYERS, 16 * 2 * 64 * 2, 40
    bounds = GroupPacing().bounds(pages, 3)
    first = n * bounds[0] * page_bytes
    mib = first / (1 << 20) if area == "first" else 64
    node = gpu_node("--stage-mib", str(mib), DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="64")
    client = node.client()
    kv = make_kv(layout, NUM_BLOCKS, LAYERS)
    fill_random(kv, 1)
    client.register_region("0", export_kv_cache(kv, block_dim=block_dim(layout)))
    client.wait_ready(60)
    hs, src = keys(n, 4), list(range(3, 3 + n))
    ref = [block_bytes(kv, layout, b).clone() for b in src]
    client.wait(client.offload(hs, src))
    fill_random(kv, 2)
    dst = list(range(50, 50 + n))
    staged, messages, counters = staged_load(node, client, hs, dst)
    assert staged.bytes == first
    assert messages[-1].HasField("done") and messages[-1].pages_landed == pages
    assert counters["staged_loads_used"] == 1
    for d, r in zip(dst, ref):
        assert torch.equal(block_bytes(kv, layout, d), r), f"block {d} onboarded wrong bytes"
    client.unregister_region("0")


def test_layerwise_load_worker_killed_mid_load(gpu_node):
    """kill -9 of the GPU worker between two layer groups of a load: the engine side's layer
    wait returns at once with a failure (no hang), and the call fails (the engine recomputes)."""
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    from kvbm_client.channels import open_channel
    from kvbm_client.connectors.core.layerwise import LayerwiseCall
    from kvbm_client.contract import pb, rpc
    from kvbm_client.leader_session import LeaderSession
    from support.fault_env import fault_env
    node = gpu_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="64", **fault_env(GROUP_DELAY_SECS="3"))
    client = node.client()
    kv = make_kv("cross", NUM_BLOCKS, LAYERS)
    fill_random(kv, 1)
    client.register_region("0", export_kv_cache(kv, block_dim=0))
    client.wait_ready(60)
    hs = keys(20, 4)
    client.wait(client.offload(hs, list(range(20))))
    with LeaderSession(node.leader_address, timeout=5) as session:
        load = session.prepare_load(hs)
        stub = rpc.WorkerStub(open_channel(node.config().worker_address("0"), node.config()))
        request = pb.TransferRequest(region_id=client.region_id("0"), engine_blocks=list(range(50, 70)),
                                     layer_groups=2, plan=pb.SignedPlan(plan=load.signed.plan,
                                                                        signature=load.signed.signature))
        call = LayerwiseCall(stub.TransferLayers(request, timeout=60), ThreadPoolExecutor(1))
        pages = 2 * LAYERS
        assert call.wait_pages(pages // 2, pages, time.monotonic() + 30), node.log()[-3000:]
        node.signal_worker("0", signal.SIGKILL)  # the second group is 3 s late: the worker dies first
        t0 = time.monotonic()
        assert not call.wait_pages(pages, pages, time.monotonic() + 30)
        assert time.monotonic() - t0 < 5, "the engine side waited on a dead worker"
        with pytest.raises(grpc.RpcError):
            call.result(5)


def test_a_gpu_layer_wait_holds_the_stream_until_its_word():
    """The engine's side alone: the wait kernel on a word of the signal page (host memory) holds
    the kernels enqueued after it until the CPU (here; the daemon's copy stream in a load)
    writes the word, a smaller value does not release it, and it gives up at its time limit."""
    import time

    from kvbm_client.signal_page import EngineSignals
    signals = EngineSignals()
    assert signals.enable_gpu(0) is None
    signal = signals.take(8)
    assert signal is not None
    x = torch.ones(1 << 20, device="cuda")
    stream = torch.cuda.Stream()
    done = torch.cuda.Event()
    try:
        with torch.cuda.stream(stream):
            signals.wait(signal, 5, stream.cuda_stream, 30.0)
            y = x * 2
            done.record(stream)
        time.sleep(0.2)
        assert not done.query(), "the kernel after the wait ran before its word was written"
        signals.words[signal.slot] = signal.base + 4
        time.sleep(0.2)
        assert not done.query(), "a smaller value released the wait"
        signals.words[signal.slot] = signal.base + 5
        end = time.monotonic() + 5
        while not done.query() and time.monotonic() < end:
            time.sleep(0.001)
        assert done.query(), "the wait was not released by its word"
        assert float(y[0]) == 2.0
        with torch.cuda.stream(stream):  # nobody writes: the wait gives up after its 0.3 s
            signals.wait(signal, 100, stream.cuda_stream, 0.3)
            done.record(stream)
        t0 = time.monotonic()
        while not done.query() and time.monotonic() - t0 < 5:
            time.sleep(0.001)
        assert done.query() and time.monotonic() - t0 >= 0.25
    finally:
        signals.release(signal)  # never leave the GPU waiting
        torch.cuda.synchronize()
        signals.close()


def test_a_layerwise_load_writes_its_word_after_its_copies(gpu_node):
    """A CUDA region with a signal page: the engine's stream waits for the load's word before
    reading the blocks (enqueued before the daemon even got the call); what it read equals the
    offloaded bytes, and the word ends at base + the pages per block."""
    from kvbm_client.channels import open_channel
    from kvbm_client.contract import pb, rpc
    from kvbm_client.leader_session import LeaderSession
    from kvbm_client.signal_page import EngineSignals, SignalledRegion
    node = gpu_node(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="64")
    client = node.client()
    kv = make_kv("cross", NUM_BLOCKS, LAYERS)
    fill_random(kv, 1)
    signals = EngineSignals()
    assert signals.enable_gpu(0) is None
    client.register_region("0", SignalledRegion(export_kv_cache(kv, block_dim=0), signals))
    client.wait_ready(60)
    hs, src = keys(40, 5), list(range(3, 43))
    ref = torch.stack([block_bytes(kv, "cross", b).clone() for b in src])
    client.wait(client.offload(hs, src))
    fill_random(kv, 2)
    pages = 2 * LAYERS
    signal = signals.take(pages)
    assert signal is not None
    dst = list(range(50, 90))
    stream = torch.cuda.Stream()
    try:
        with torch.cuda.stream(stream):
            signals.wait(signal, pages, stream.cuda_stream, 30.0)
            seen = torch.stack([block_bytes(kv, "cross", d) for d in dst])  # read after the word only
        with LeaderSession(node.leader_address, timeout=5) as session:
            load = session.prepare_load(hs)
            assert load.num_blocks == 40
            stub = rpc.WorkerStub(open_channel(node.config().worker_address("0"), node.config()))
            request = pb.TransferRequest(region_id=client.region_id("0"), engine_blocks=dst, layer_groups=3,
                                         signal_slot=signal.slot + 1, signal_base=signal.base,
                                         plan=pb.SignedPlan(plan=load.signed.plan, signature=load.signed.signature))
            messages = list(stub.TransferLayers(request, timeout=30))
        assert messages[-1].HasField("done"), node.log()[-3000:]
        assert int(signals.words[signal.slot]) == signal.base + pages
        stream.synchronize()
        assert torch.equal(seen, ref), "the engine's stream read the blocks before their word said they landed"
    finally:
        signals.release(signal)
        torch.cuda.synchronize()
        client.unregister_region("0")
        signals.close()


@pytest.mark.parametrize("layout", ["cross", "layers"])
def test_a_staged_loads_words_wait_for_its_scatter(gpu_node, layout):
    """A staged load (``--stage-mib`` over the load; its first group staged): the scatter runs
    beside the load stream, and the load's words still come after it. The engine's stream,
    waiting for the first group's word and then the last, reads those pages equal to the
    offloaded bytes (enqueued before the daemon got the calls).

    The load is large (1.6 GiB; its first group 1000 MiB, ~19 ms of staging copies on an H100),
    so the binding call comes while the staging copies still run: the job's pieces are timed
    (``DYN_LOG=debug``) against a clock that must not wait for them (first run on an H100: every
    such job failed, ``cudaEventElapsedTime: cudaErrorNotReady``, the mark queued behind the
    staging copies)."""
    from kvbm_client.signal_page import EngineSignals, SignalledRegion
    from kvbm_worker.grouping import GroupPacing
    tokens, heads, dim = 256, 16, 128
    pages, page_bytes, n = 2 * LAYERS, tokens * heads * dim * 2, 200
    first = GroupPacing().bounds(pages, 3)[0]
    node = gpu_node("--stage-mib", str(n * pages * page_bytes >> 20), DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="256")
    client = node.client()
    kv = make_kv(layout, 2 * n + 20, LAYERS, tokens=tokens, heads=heads, dim=dim)
    fill_random(kv, 1)
    signals = EngineSignals()
    assert signals.enable_gpu(0) is None
    client.register_region("0", SignalledRegion(export_kv_cache(kv, block_dim=block_dim(layout)), signals))
    client.wait_ready(60)
    hs, src = keys(n, 6), list(range(n))
    ref = torch.stack([block_bytes(kv, layout, b).clone() for b in src])
    client.wait(client.offload(hs, src))
    fill_random(kv, 2)
    signal = signals.take(pages)
    assert signal is not None
    dst = list(range(n + 10, 2 * n + 10))
    stream = torch.cuda.Stream()
    try:
        with torch.cuda.stream(stream):  # read after each word only
            signals.wait(signal, first, stream.cuda_stream, 30.0)
            seen_first = torch.stack([block_bytes(kv, layout, d)[:first * page_bytes] for d in dst])
            signals.wait(signal, pages, stream.cuda_stream, 30.0)
            seen = torch.stack([block_bytes(kv, layout, d) for d in dst])
        staged, messages, counters = staged_load(node, client, hs, dst, signal_slot=signal.slot + 1,
                                                 signal_base=signal.base)
        assert staged.bytes == n * first * page_bytes, "the first group staged"
        assert messages[-1].HasField("done"), node.log()[-3000:]
        assert counters["staged_loads_used"] == 1
        assert int(signals.words[signal.slot]) == signal.base + pages
        stream.synchronize()
        assert torch.equal(seen_first, ref[:, :first * page_bytes]), "the first group's word passed before its scatter"
        assert torch.equal(seen, ref), "the last word passed before every group was in the blocks"
    finally:
        signals.release(signal)
        torch.cuda.synchronize()
        client.unregister_region("0")
        signals.close()


@pytest.mark.parametrize("variant", ["plain", "no_mul"])
def test_under_lazy_module_loading_a_gpu_wait_holds_its_stream_until_another_process_writes_the_word(variant):
    """CUDA's lazy loading (its default; this test process loads eagerly, so the probe runs in a
    child): the wait, a "done" word copied back after it, then (``plain``) a kernel whose module
    is loaded only at its launch. The word is written 0.2 s later by another process, as the
    daemon writes it (``benchmarks/wait_kernel_probe.py``): the stream must not pass the wait
    before the word, and the wait must end on the word, not at its 2 s limit."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CUDA_MODULE_LOADING": "LAZY",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(repo / "benchmarks" / "wait_kernel_probe.py"), variant],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loading"] == "LAZY"
    assert not got["passed_early"], got
    assert got["read_last"] == got["word"], got  # released by the word, not by the limit
    assert got["done_after"] == 1, got
    assert 0.15e9 <= got["waited_ns"] < 1.5e9, got
