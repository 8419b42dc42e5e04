"""Every copy mechanism, both layouts, both directions: bytes equal to a reference on the GPU."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import cuda_ready

if cuda_ready():
    pytest.skip(cuda_ready(), allow_module_level=True)

import torch  # noqa: E402

from gpu_kv import block_bytes, fill_random, local_region, make_kv  # noqa: E402
from kvbm_worker.handlers.cuda import CudaCopier, Direction  # noqa: E402
from kvbm_worker.handlers.pinned import PinnedHost  # noqa: E402
from kvbm_worker.pools import HostPool, SlotGeometry  # noqa: E402

NUM_BLOCKS, LAYERS, SLOTS = 48, 3, 40


@pytest.fixture(scope="module")
def pool():
    host = HostPool(SlotGeometry.of(LAYERS * 2 * 16 * 2 * 64 * 2, SLOTS))
    pinned = PinnedHost(0)
    # several registrations, edges inside slots: runs must be cut there
    pinned.pin(host.address, host.buffer.nbytes, chunk=7 * host.geometry.slot_bytes + 4096)
    yield host, pinned
    pinned.close()
    host.close()


@pytest.mark.parametrize("layout", ["cross", "layers"])
@pytest.mark.parametrize("mechanism", ["runs", "batch", "direct", "gather", "auto"])
def test_offload_then_onboard_elsewhere_bytes_equal(pool, layout, mechanism):
    host, pinned = pool
    kv = make_kv(layout, NUM_BLOCKS, LAYERS)
    fill_random(kv, seed=hash((layout, mechanism)) % 1000)
    region = local_region(kv, layout)
    bb = region.block_bytes
    assert bb == host.geometry.block_bytes
    # staging of 3 blocks: the gather path runs in several chunks
    copier = CudaCopier(0, pinned, mechanism, staging_bytes=3 * bb)
    rng = np.random.default_rng(0)
    src = rng.choice(NUM_BLOCKS // 2, 20, replace=False)
    slots = np.concatenate([np.arange(5, 15), rng.choice(np.arange(20, SLOTS), 10, replace=False)])
    addrs = host.address + slots * host.geometry.slot_bytes
    host.slots[:] = 0xA5  # poison
    copier.copy("d2h", region, src, addrs)
    if mechanism == "direct":  # its check copy at start passed on this GPU
        assert copier.last_mechanism == "direct"
    elif mechanism == "auto":  # auto takes direct wherever it passed that check
        assert copier.last_mechanism == ("direct" if copier._direct is not None else "batch")
    for b, s in zip(src, slots):
        ref = block_bytes(kv, layout, int(b)).cpu().numpy()
        assert np.array_equal(host.slots[s, :bb], ref), f"{mechanism}: slot {s} != block {b}"
    untouched = np.setdiff1d(np.arange(SLOTS), slots)
    assert (host.slots[untouched] == 0xA5).all(), "an offload wrote outside its slots"

    before = [t.clone() for t in ([kv] if layout == "cross" else kv)]
    dst = NUM_BLOCKS // 2 + rng.choice(NUM_BLOCKS // 2, 20, replace=False)
    copier.copy("h2d", region, dst, addrs)
    for b, d in zip(src, dst):
        assert torch.equal(block_bytes(kv, layout, int(d)), block_bytes(kv, layout, int(b))), \
            f"{mechanism}: block {d} != block {b}"
    others = [i for i in range(NUM_BLOCKS) if i not in set(dst.tolist())]
    keep = torch.tensor(others, device="cuda")
    for old, new in zip(before, [kv] if layout == "cross" else kv):
        bd = 0 if layout == "cross" else 1  # compare bytes: random bf16 holds NaNs
        assert torch.equal(old.index_select(bd, keep).view(torch.uint8),
                           new.index_select(bd, keep).view(torch.uint8)), "an onboard wrote elsewhere"
    copier.close()


@pytest.mark.parametrize("layout", ["cross", "layers"])
@pytest.mark.parametrize("mechanism", ["batch", "direct", "runs", "gather"])
def test_onboard_in_page_groups_lands_only_those_pages(pool, layout, mechanism):
    """Layer-pipelined loads: a copy of pages [lo, hi) writes exactly those pages of each block
    (gather falls back to direct DMA for a page range)."""
    host, pinned = pool
    kv = make_kv(layout, NUM_BLOCKS, LAYERS)
    fill_random(kv, seed=7)
    region = local_region(kv, layout)
    bb, page = region.block_bytes, region.page_bytes
    copier = CudaCopier(0, pinned, mechanism)
    src, dst = np.arange(0, 12), np.arange(30, 42)
    slots = np.arange(12)
    addrs = host.address + slots * host.geometry.slot_bytes
    copier.copy("d2h", region, src, addrs)
    fill_random(kv, seed=8)  # the destination blocks hold other bytes
    old = [block_bytes(kv, layout, int(d)).clone() for d in dst]
    first = region.num_layers // 2
    copier.copy("h2d", region, dst, addrs, pages=(0, first))
    for i, d in enumerate(dst):
        now = block_bytes(kv, layout, int(d)).cpu().numpy()
        assert np.array_equal(now[:first * page], host.slots[slots[i], :first * page]), "group 0 did not land"
        assert np.array_equal(now[first * page:], old[i].cpu().numpy()[first * page:]), "group 0 wrote later pages"
    mark = copier.now()
    done = copier.copy("h2d", region, dst, addrs, pages=(first, region.num_layers), timed=True)
    assert mark.elapsed_time(done) >= 0.0  # the GPU's clock of a piece (the lane's debug line)
    for i, d in enumerate(dst):
        assert np.array_equal(block_bytes(kv, layout, int(d)).cpu().numpy(), host.slots[slots[i], :bb])
    with pytest.raises(ValueError):
        copier.copy("h2d", region, dst, addrs, pages=(0, region.num_layers + 1))
    copier.close()


def test_a_signal_word_is_written_after_the_copies_before_it_without_waiting_for_them(pool):
    """``write_word`` into CUDA-registered host memory (the engine's signal page, here a page of
    this process) queues behind the stream's copies and returns at once: the call does not wait
    for a 1 GiB copy queued before it (a host -> host copy would: CUDA runs those synchronously),
    the word is not written before that copy ends, and it holds the value once its event fired."""
    import mmap
    import time

    from kvbm_worker.cuda_region import check, cudart
    from kvbm_worker.handlers.cuda_copier import Direction
    host, pinned = pool
    copier = CudaCopier(0, pinned)
    rt = cudart()
    page = mmap.mmap(-1, 4096)
    words = np.frombuffer(page, dtype="<u4")
    addr = words.ctypes.data
    check(rt.cudaHostRegister(addr, 4096, rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable), "register")
    big_src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    big_dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    try:
        ptr = int(check(rt.cudaHostGetDevicePointer(addr, 0), "device pointer"))
        copier.write_word(Direction.H2D, ptr + 8, 1).synchronize()  # (warm: the word buffers exist)
        assert int(words[2]) == 1
        stream = copier.streams[Direction.H2D]
        with torch.cuda.stream(stream):
            big_dst.copy_(big_src, non_blocking=True)  # ~20 ms at the DMA's pace
        t0 = time.perf_counter()
        event = copier.write_word(Direction.H2D, ptr + 8, 7)
        call_s = time.perf_counter() - t0
        seen_early = int(words[2])
        event.synchronize()
        assert call_s < 0.005, f"write_word waited {call_s * 1e3:.1f} ms for the copy before it"
        assert seen_early == 1, "the word was written before the copy queued ahead of it ended"
        assert int(words[2]) == 7
    finally:
        torch.cuda.synchronize()
        rt.cudaHostUnregister(addr)
        copier.close()


@pytest.mark.parametrize("layout", ["cross", "layers"])
def test_loads_issued_from_several_threads_land_every_byte_before_their_event(layout):
    """``issue_threads``: a load's copies split among three threads (:mod:`kvbm_worker.handlers.issuers`)
    land exactly their bytes, and the event ``copy`` returns fires only after every share landed
    (the bytes are compared right after it: a share the caller's stream did not wait for would
    still be copying). Whole blocks and a page range, 36 layers of a per-layer cache: ~9K copies."""
    n, layers = 128, 36
    kv = make_kv(layout, 2 * n, layers, heads=8, dim=128)
    fill_random(kv, seed=11)
    region = local_region(kv, layout)
    host = HostPool(SlotGeometry.of(region.block_bytes, n))
    pinned = PinnedHost(0)
    try:
        pinned.pin(host.address, host.buffer.nbytes, chunk=(n // 3) * host.geometry.slot_bytes)
        copier = CudaCopier(0, pinned, "direct", issue_threads=3, split_min=64)
        assert copier._direct is not None, "the direct calls failed their check on this GPU"
        src, dst = np.arange(n), n + np.random.default_rng(3).permutation(n)
        addrs = host.address + np.arange(n) * host.geometry.slot_bytes
        copier.copy("d2h", region, src, addrs)
        fill_random(kv, seed=12)
        page, half = region.page_bytes, region.num_layers // 2
        copier.copy("h2d", region, dst, addrs, wait=False, pages=(0, half)).synchronize()
        for i, d in enumerate(dst.tolist()):
            now = block_bytes(kv, layout, d).cpu().numpy()
            assert np.array_equal(now[:half * page], host.slots[i, :half * page]), f"block {d}: pages not landed"
        copier.copy("h2d", region, dst, addrs, wait=False).synchronize()
        for i, d in enumerate(dst.tolist()):
            assert np.array_equal(block_bytes(kv, layout, d).cpu().numpy(), host.slots[i, :region.block_bytes])
        assert copier._issuers is not None and copier._issuers.splits(n * half)
        copier.close()
    finally:
        pinned.close()
        host.close()


def test_stores_give_up_the_interpreter_lock_and_short_loads_keep_it():
    """A store's direct call releases the interpreter lock (a per-layer cache's store is thousands of
    copies: the load lane and the event loop run meanwhile); a load under the split threshold keeps
    it. The bytes still land (compared after each copy's event)."""
    n, layers = 32, 36
    kv = make_kv("layers", 2 * n, layers, heads=8, dim=128)
    fill_random(kv, seed=21)
    region = local_region(kv, "layers")
    host = HostPool(SlotGeometry.of(region.block_bytes, n))
    pinned = PinnedHost(0)
    try:
        pinned.pin(host.address, host.buffer.nbytes)
        copier = CudaCopier(0, pinned, "direct", issue_threads=2, split_min=1 << 20)
        assert copier._direct is not None, "the direct calls failed their check on this GPU"
        calls: list[tuple[int, bool]] = []
        batch = copier._direct.batch

        def spy(dst, src, lengths, stream, release=False):
            calls.append((stream, release))
            batch(dst, src, lengths, stream, release=release)

        copier._direct.batch = spy  # type: ignore[method-assign]
        src, dst = np.arange(n), n + np.arange(n)[::-1].copy()
        addrs = host.address + np.arange(n) * host.geometry.slot_bytes
        copier.copy("d2h", region, src, addrs)
        stores = [r for st, r in calls if st == copier.streams[Direction.D2H].cuda_stream]
        assert stores and all(stores), calls
        calls.clear()
        copier.copy("h2d", region, dst, addrs, wait=False).synchronize()
        loads = [r for st, r in calls if st == copier.streams[Direction.H2D].cuda_stream]
        assert loads and not any(loads), calls
        for i, d in enumerate(dst.tolist()):
            assert np.array_equal(block_bytes(kv, "layers", d).cpu().numpy(), host.slots[i, :region.block_bytes])
        copier.close()
    finally:
        pinned.close()
        host.close()


def test_a_staging_area_that_does_not_fit_names_the_flag():
    from kvbm_worker.handlers.cuda_stage import CudaStage
    pinned = PinnedHost(0)
    copier = CudaCopier(0, pinned)
    try:
        too_big = torch.cuda.get_device_properties(0).total_memory + (1 << 30)
        with pytest.raises(MemoryError, match=r"staging area \(--stage-mib [0-9.]+\) does not fit in cuda:0"):
            CudaStage(copier, too_big)
    finally:
        copier.close()
        pinned.close()
