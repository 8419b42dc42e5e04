"""The engine's signal page on the real daemons (a CPU region: the CPU medium stores the words;
a GPU worker writes them on its copy stream, tests/gpu): a layer-grouped load writes
``base + pages landed`` into the word it names after each group's bytes, a joining call's word
catches up, and a bad word or page is refused before a byte moves. The engine side's GPU waits
(``LayerwiseCall`` with a ``GpuWait``) are checked here with their driver call recorded."""
from __future__ import annotations

import fcntl
import os
import threading
import time

import grpc
import numpy as np
import pytest

from kvbm_client.connectors.core.layerwise import GpuWait, LayerwiseCall
from kvbm_client.connectors.core.transfers import TransferTracker
from kvbm_client.contract import SIGNAL_PAGE_BYTES, pb
from kvbm_client.region_wire import RegionRefused, register
from kvbm_client.regions import ShmKvBuffer
from kvbm_client.signal_page import SPAN, EngineSignals, SignalledRegion
from support.fault_env import fault_env

from test_layerwise_loads import LAYERS, PAGE, Setup, hashes

BLOCKS = 64


class SignalledEngine:
    """A second engine region of the test node's shape, registered with a signal page."""

    def __init__(self, s: Setup, signals: EngineSignals | None = None) -> None:
        self.kv = ShmKvBuffer(BLOCKS, LAYERS, PAGE)
        self.signals = signals or EngineSignals()
        self.lease = register(s.node.config().region_socket("0"),
                              SignalledRegion(self.kv.spec(), self.signals).to_request(),
                              SignalledRegion(self.kv.spec(), self.signals).fds, timeout=10)
        self.region_id = self.lease.region_id

    def word(self, slot: int) -> int:
        return int(self.signals.words[slot])

    def close(self) -> None:
        self.lease.close()
        self.kv.close()
        self.signals.close()


def request(s: Setup, region_id: str, blocks: list[int], groups: int, slot: int = 0, base: int = 0
            ) -> "pb.TransferRequest":
    r = s.request(blocks, groups)
    r.region_id = region_id
    r.signal_slot, r.signal_base = slot, base
    return r


def test_a_load_writes_its_word_after_each_group_landed(make_node):
    s = Setup(make_node(**fault_env(GROUP_DELAY_SECS="0.3")))
    e = SignalledEngine(s)
    try:
        dst, slot, base = [40, 41, 42, 43, 44, 45], 5, 3 * SPAN
        seen: list[tuple[int, bool]] = []  # (word, were its pages there when it was read)
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                word = e.word(slot)
                end = word - base if word >= base else 0
                seen.append((word, bool(np.array_equal(e.kv.array[dst][:, :end], s.array[0:6][:, :end]))))
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        messages = list(s.stub.TransferLayers(request(s, e.region_id, dst, 4, slot + 1, base), timeout=20))
        stop.set()
        watcher.join()
        assert messages[-1].HasField("done")
        assert e.word(slot) == base + LAYERS
        words = [w for w, _ in seen if w]
        assert words == sorted(words), "a word went back"
        # 4 front-loaded groups of 8 pages end at 4, 6, 7, 8; each later group 0.3 s late
        assert {w - base for w in words} >= {4, 6, 7} and set(words) <= {base + 4, base + 6, base + 7, base + 8}
        assert all(ok for _, ok in seen), "a word counted pages that had not landed"
        assert all(e.word(i) == 0 for i in range(SIGNAL_PAGE_BYTES // 4) if i != slot), "another word was written"
        assert np.array_equal(e.kv.array[dst], s.array[0:6])
    finally:
        e.close()


def test_a_joining_call_adds_its_word_to_the_running_job(make_node):
    """The scheduler side's early Transfer starts the job without a word; the worker side's
    TransferLayers joins with one, which the lane writes from then on (the CPU medium: at its
    next copy, with the pages landed so far), never ahead of the bytes."""
    s = Setup(make_node(**fault_env(GROUP_DELAY_SECS="0.5")))
    e = SignalledEngine(s)
    try:
        dst, base = [30, 31, 32, 33, 34, 35], 7 * SPAN
        early = s.stub.Transfer.future(request(s, e.region_id, dst, 2), timeout=10)
        time.sleep(0.2)  # the first group (6 of 8 pages) landed, the second is 0.5 s late
        stream = s.stub.TransferLayers(request(s, e.region_id, dst, 2, 1, base), timeout=10)
        assert next(stream).pages_landed == 6
        assert e.word(0) in (0, base + 6), "the word got ahead of the bytes"
        rest = list(stream)
        assert rest[-1].done.joined and early.result().bytes == rest[-1].done.bytes
        assert e.word(0) == base + LAYERS
        assert np.array_equal(e.kv.array[dst], s.array[0:6])
    finally:
        e.close()


@pytest.mark.parametrize("slot, base, why", [(1025, 0, "1 to 1024"), (1, (1 << 32) - 4, "32 bits")])
def test_a_word_outside_the_page_or_the_values_is_refused_and_nothing_moves(make_node, slot, base, why):
    s = Setup(make_node())
    e = SignalledEngine(s)
    try:
        dst = [50, 51, 52, 53, 54, 55]
        with pytest.raises(grpc.RpcError) as err:
            list(s.stub.TransferLayers(request(s, e.region_id, dst, 2, slot, base), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
        assert not e.kv.array[dst].any() and not e.signals.words.any()
    finally:
        e.close()


def test_a_word_of_a_region_without_a_page_or_of_a_store_is_refused(make_node):
    s = Setup(make_node())
    with pytest.raises(grpc.RpcError) as err:  # the node's own engine registered no page
        list(s.stub.TransferLayers(request(s, s.region_id, [52, 53, 54, 55, 56, 57], 2, 1, 0), timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "without a signal page" in err.value.details()
    e = SignalledEngine(s)
    try:
        store = s.session.prepare_store(hashes(2, seed=5))
        r = request(s, e.region_id, [0, 1], 0, 1, 0)
        r.plan.CopyFrom(pb.SignedPlan(plan=store.signed.plan, signature=store.signed.signature))
        with pytest.raises(grpc.RpcError) as err:
            s.stub.Transfer(r, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "loads only" in err.value.details()
    finally:
        e.close()


def _page_fd(size: int, seal: bool) -> int:
    fd = os.memfd_create("bad-signals", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


@pytest.mark.parametrize("size, seal, fd_first, why", [
    (SIGNAL_PAGE_BYTES, False, False, "not sealed against shrinking"),
    (2 * SIGNAL_PAGE_BYTES, True, False, "exactly 4096"),
    (SIGNAL_PAGE_BYTES, True, True, "must be the last"),
])
def test_a_bad_signal_page_is_refused_at_registration(make_node, size, seal, fd_first, why):
    s = Setup(make_node())
    kv, fd = ShmKvBuffer(BLOCKS, LAYERS, PAGE), _page_fd(size, seal)
    try:
        req = kv.spec().to_request()
        fds = [fd, kv.fd] if fd_first else [kv.fd, fd]
        req.signals.CopyFrom(pb.RegionBuffer(fd_index=0 if fd_first else 1, size_bytes=SIGNAL_PAGE_BYTES, device=-1))
        if fd_first:
            req.buffers[0].fd_index = 1
        with pytest.raises(RegionRefused) as err:
            register(s.node.config().region_socket("0"), req, fds, timeout=10)
        assert why in str(err.value)
    finally:
        os.close(fd)
        kv.close()


class RecordedWaits(EngineSignals):
    """The engine's page with the driver's stream wait recorded instead of enqueued (no GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.device_ptr, self._kernel = 1, "registered"
        self.waits: list[tuple[int, int, int]] = []

    def wait(self, signal, end, stream, seconds):
        assert 0 < seconds <= 30
        self.waits.append((signal.slot, signal.base + end, stream))


def gpu_call(s: Setup, e: SignalledEngine, signals: RecordedWaits, dst: list[int], settled=lambda exc: True,
             gpu_from: int = 0) -> LayerwiseCall:
    signal = signals.take(LAYERS)
    assert signal is not None
    r = request(s, e.region_id, dst, 2, signal.slot + 1, signal.base)
    return LayerwiseCall(s.stub.TransferLayers(r, timeout=20), s.readers,
                         GpuWait(signals, signal, settled, lambda: 77, time.monotonic() + 20, gpu_from))


def test_the_engine_enqueues_its_layer_waits_and_releases_the_word_at_the_outcome(make_node):
    """With a word, the forward's layer waits return at once (enqueued on the forward's stream,
    here recorded), the daemon writes the word as groups land, and the word is released (every
    wait passes) once the load answered, then given back at settle."""
    s = Setup(make_node(**fault_env(GROUP_DELAY_SECS="0.5")))
    signals = RecordedWaits()
    e = SignalledEngine(s, signals)
    try:
        dst = [20, 21, 22, 23, 24, 25]
        signal_free = len(signals._free)
        call = gpu_call(s, e, signals, dst)
        tracker = TransferTracker()
        tracker.load_sent("req-1", call, dst, sync=True, answer_by=time.monotonic() + 20)
        t0 = time.monotonic()
        tracker.wait_sync_pages(2, LAYERS)
        tracker.wait_sync_pages(LAYERS, LAYERS)
        assert time.monotonic() - t0 < 0.3, "a layer wait blocked the CPU"
        slot, base = call.gpu.signal.slot, call.gpu.signal.base  # type: ignore[union-attr]
        assert [(w[0], w[1] - base, w[2]) for w in signals.waits][-1] == (slot, LAYERS, 77)
        assert tracker.settle_sync_loads() is False  # the outcome: no failure
        assert int(e.signals.words[slot]) == base + SPAN - 1  # released after the daemon's base + 8
        assert len(signals._free) == signal_free, "the word was not given back"
        assert np.array_equal(e.kv.array[dst], s.array[0:6])
    finally:
        e.close()


@pytest.mark.parametrize("end,on_gpu", [(LAYERS - 1, False), (LAYERS, True)])
def test_under_tail_only_the_last_layers_wait_on_the_gpu(make_node, end, on_gpu):
    """``gpu_layer_waits`` tail (``GpuWait.gpu_from``, here the last layer): a layer whose pages
    end at or before ``gpu_from`` waits on the CPU (it blocks until its group landed, nothing is
    enqueued); the last layer's wait is enqueued on the forward's stream and returns at once.
    The load runs in two groups (pages [0, 6) and [6, 8)), the second landing 0.5 s late."""
    s = Setup(make_node(**fault_env(GROUP_DELAY_SECS="0.5")))
    signals = RecordedWaits()
    e = SignalledEngine(s, signals)
    try:
        dst = [40, 41, 42, 43, 44, 45]
        call = gpu_call(s, e, signals, dst, gpu_from=LAYERS - 1)
        tracker = TransferTracker()
        tracker.load_sent("req-1", call, dst, sync=True, answer_by=time.monotonic() + 20)
        t0 = time.monotonic()
        tracker.wait_sync_pages(end, LAYERS)
        took = time.monotonic() - t0
        if on_gpu:
            assert took < 0.3, "the last layer's wait blocked the CPU"
            assert [w[1] - call.gpu.signal.base for w in signals.waits] == [LAYERS]  # type: ignore[union-attr]
        else:
            assert took >= 0.4, f"layer {end - 1}'s wait returned before its late group landed ({took:.2f} s)"
            assert signals.waits == [], "a wait before the tail went on the GPU"
        assert tracker.settle_sync_loads() is False
        assert np.array_equal(e.kv.array[dst], s.array[0:6])
    finally:
        e.close()


def test_a_failed_load_releases_its_word_only_once_no_copy_can_land(make_node):
    """A failed load's reader releases the word only when ``failure_settled`` says no copy can
    still land; else the engine's thread does once it settled the load (``end_signal``)."""
    s = Setup(make_node())
    signals = RecordedWaits()
    e = SignalledEngine(s, signals)
    try:
        decided: list[grpc.StatusCode] = []

        def settled(exc) -> bool:
            decided.append(exc.code())
            return False  # "the daemon did not answer and could not be stopped"

        dst = [2, 3, 4, 5, 6, 7]
        s.session.release(s.load)  # the leader says no: the daemon answers FAILED_PRECONDITION
        call = gpu_call(s, e, signals, dst, settled)
        with pytest.raises(grpc.RpcError):
            call.result(10)
        time.sleep(0.1)
        slot, base = call.gpu.signal.slot, call.gpu.signal.base  # type: ignore[union-attr]
        assert decided and int(e.signals.words[slot]) != base + SPAN - 1, "released against failure_settled"
        call.end_signal()  # the engine's thread settled it
        assert int(e.signals.words[slot]) == base + SPAN - 1
    finally:
        e.close()
