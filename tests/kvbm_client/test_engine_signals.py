"""The engine's signal page without a GPU: words are handed out with values that only grow,
released above every wait of their load, and the worker side decides when a failed load's
word may be released from a progress reader."""
from __future__ import annotations

import time
from types import SimpleNamespace

import grpc

from kvbm_client.connectors.core.settings import ConnectorSettings
from kvbm_client.connectors.core.worker import WorkerCore
from kvbm_client.contract import SIGNAL_SLOTS
from kvbm_client.ids import WorkerId
from kvbm_client.signal_page import MAX_SEQ, SPAN, EngineSignals, SignalledRegion
from kvbm_client.regions import ShmKvBuffer


def test_a_word_serves_one_load_at_a_time_with_growing_bases():
    signals = EngineSignals()
    try:
        taken = [signals.take(36) for _ in range(SIGNAL_SLOTS)]
        assert all(t is not None for t in taken) and signals.take(36) is None  # every word is out
        first = taken[0]
        assert first is not None and first.base == SPAN  # seq 1: a fresh page's 0 never satisfies a wait
        signals.release(first)
        assert signals.words[first.slot] == first.base + SPAN - 1  # above every base + end of its load
        signals.give_back(first)
        again = signals.take(36)
        assert again is not None and again.slot == first.slot and again.base == first.base + SPAN
        assert again.base > int(signals.words[first.slot]), "a released value would satisfy the next load's waits"
        assert signals.take(SPAN) is None  # pages per block must stay below SPAN
    finally:
        signals.close()


def test_a_worn_out_word_is_never_handed_out_again():
    signals = EngineSignals()
    try:
        signals._seq[0] = MAX_SEQ
        got = {signals.take(8).slot for _ in range(SIGNAL_SLOTS - 1)}  # type: ignore[union-attr]
        assert 0 not in got and signals.take(8) is None
        assert MAX_SEQ * SPAN + SPAN - 1 < 1 << 32
    finally:
        signals.close()


def test_the_page_goes_last_in_the_registration():
    kv, signals = ShmKvBuffer(4, 2, 64), EngineSignals()
    try:
        region = SignalledRegion(kv.spec(), signals)
        req = region.to_request()
        assert list(region.fds) == [kv.fd, signals.fd] and req.signals.fd_index == 1
        assert req.buffers[0].fd_index == 0 and len(req.layers) == 2
    finally:
        kv.close()
        signals.close()


class Err(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


class Daemon:
    def __init__(self, held: bool, gone: bool = False, killable: bool = True) -> None:
        self.held, self._gone, self.killable, self.kills, self.pid = held, gone, killable, 0, 4242

    def gone(self):
        return self._gone

    def wait_gone(self, timeout):  # a fake process does not exit by itself: as gone() now
        return self._gone

    def kill(self, timeout):
        self.kills += 1
        self._gone = self.killable
        return self.killable


def core(daemon: Daemon) -> WorkerCore:
    settings = ConnectorSettings("unix:/nowhere/l.sock", "unix:/nowhere/w-{id}.sock", "m", 1.0, 1.0)
    c = WorkerCore(WorkerId("0"), settings, link=SimpleNamespace(failed=lambda exc: None))  # type: ignore[arg-type]
    c.daemon = daemon  # type: ignore[assignment]
    return c


def test_a_daemons_own_failure_releases_at_once_an_unanswered_one_after_the_daemon_is_stopped():
    later, past = time.monotonic() + 60, time.monotonic() - 1
    held = Daemon(held=True)
    c = core(held)
    for code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS,
                 grpc.StatusCode.DEADLINE_EXCEEDED):  # the daemon's DEADLINE_EXCEEDED comes before the call's own
        assert c._failure_settled(Err(code), later) and held.kills == 0
    assert c._failure_settled(Err(grpc.StatusCode.DEADLINE_EXCEEDED), past) and held.kills == 1  # unanswered: killed
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        d = Daemon(held=True)
        assert core(d)._failure_settled(Err(code), later) and d.kills == 1
    exited = Daemon(held=True, gone=True)
    assert core(exited)._failure_settled(Err(grpc.StatusCode.UNAVAILABLE), later) and exited.kills == 0
    stuck = Daemon(held=True, killable=False)
    assert not core(stuck)._failure_settled(Err(grpc.StatusCode.UNAVAILABLE), later)  # still there: not released
    assert not core(Daemon(held=False))._failure_settled(RuntimeError("stream broke"), later)  # cannot stop it here


def test_a_daemon_that_exited_mid_load_is_not_killed_and_is_told_once(caplog):
    """Both the progress reader and the engine's thread ask about the same dead daemon: one
    warning that it exited, no kill, no "killing it"."""
    exited = Daemon(held=True, gone=True)
    c = core(exited)
    with caplog.at_level("WARNING", logger="kvbm.connector"):
        for _ in range(2):
            assert c._held_daemon_gone()
    assert exited.kills == 0
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1 and "exited with a load in flight" in told[0] and "killing" not in told[0]


def test_without_a_gpu_enabling_gpu_waits_says_why_and_leaves_the_cpu_waits():
    """On a machine without CUDA (CI), or with lazy module loading, ``enable_gpu`` never raises:
    it returns the reason, and the page hands out no GPU waits."""
    import pytest
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU machine: tests/gpu covers enable_gpu")
    except ImportError:
        pass
    signals = EngineSignals()
    try:
        why = signals.enable_gpu(0)
        assert isinstance(why, str) and why
        assert not signals.on_gpu and signals.device_ptr is None
    finally:
        signals.close()
