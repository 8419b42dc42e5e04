"""Issuers' ordering rules, with a stand-in for the CUDA runtime's calls (``FakeDirect``, pure
Python: it records which stream got which copies and which event waits; the real calls are
covered on a GPU by ``tests/gpu/test_cuda_copier.py``'s issue-thread cases)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvbm_worker.handlers.issuers import Issuers


class FakeEvent:
    def __init__(self, log: "FakeDirect") -> None:
        self.log, self.stream = log, None

    def record(self, stream: int) -> None:
        self.stream = stream
        self.log.calls.append(("record", stream, self))


class FakeStream:
    count = 100

    def __init__(self, device: int) -> None:
        FakeStream.count += 1
        self.cuda_stream = FakeStream.count

    def synchronize(self) -> None:
        pass


class FakeDirect:
    """Records every call; ``fail_on``: a stream whose batch raises."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.calls: list[tuple] = []
        self.copies: dict[int, list[int]] = {}
        self.lock = threading.Lock()
        self.fail_on = fail_on

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def wait(self, stream: int, event: FakeEvent) -> None:
        with self.lock:
            self.calls.append(("wait", stream, event))

    def batch(self, dst, src, lengths, stream: int, release: bool = False) -> None:
        assert release, "a share's call must give up the interpreter lock"
        if stream == self.fail_on:
            raise RuntimeError("cudaMemcpyBatchAsync: cudaErrorInvalidValue")
        with self.lock:
            self.copies.setdefault(stream, []).extend(int(s) for s in src)
            self.calls.append(("batch", stream, len(src)))


def make(threads: int, fail_on: int | None = None, min_copies: int = 8) -> tuple[Issuers, FakeDirect]:
    direct = FakeDirect(fail_on)
    issuers = Issuers(direct, 0, threads, min_copies, make_stream=FakeStream, bind=None)  # type: ignore[arg-type]
    return issuers, direct


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_every_copy_is_issued_once_in_contiguous_shares_and_the_caller_waits_for_each(threads):
    issuers, direct = make(threads)
    n, main = 1001, 7
    src = np.arange(n, dtype=np.int64) * 10
    issuers.issue(src + 1, src, np.full(n, 10, np.int64), main)
    issuers.close()
    issued = sorted(s for copies in direct.copies.values() for s in copies)
    assert issued == src.tolist()
    assert len(direct.copies) == threads and main in direct.copies
    for copies in direct.copies.values():  # each share a contiguous slice
        assert copies == list(range(copies[0], copies[0] + 10 * len(copies), 10))
    before = next(c[2] for c in direct.calls if c[0] == "record" and c[1] == main)
    helpers = [s for s in direct.copies if s != main]
    for h in helpers:  # a helper waited for the caller's stream before its copies
        waits = [i for i, c in enumerate(direct.calls) if c[0] == "wait" and c[1] == h and c[2] is before]
        first = min(i for i, c in enumerate(direct.calls) if c[0] == "batch" and c[1] == h)
        assert waits and waits[0] < first
    done = {c[2] for c in direct.calls if c[0] == "record" and c[1] in helpers}
    waited = {c[2] for c in direct.calls if c[0] == "wait" and c[1] == main}
    assert done and done == waited  # the caller's stream waits for every share's end


def test_short_lists_are_not_split_and_one_thread_never_splits():
    issuers, _ = make(2, min_copies=64)
    assert not issuers.splits(63) and issuers.splits(64)
    single, _ = make(1)
    assert not single.splits(10_000)
    with pytest.raises(ValueError):
        Issuers(FakeDirect(), 0, 9, 64, make_stream=FakeStream, bind=None)  # type: ignore[arg-type]


def test_a_failed_share_is_raised_after_every_other_share_was_waited_for():
    issuers, direct = make(3)
    victim = issuers._streams[0].cuda_stream
    direct.fail_on = victim
    main = 5
    src = np.arange(300, dtype=np.int64)
    with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
        issuers.issue(src, src, np.ones(300, np.int64), main)
    issuers.close()
    survivors = [s for s in direct.copies if s not in (main, victim)]
    assert len(survivors) == 1
    done = [c[2] for c in direct.calls if c[0] == "record" and c[1] == survivors[0]]
    assert any(c[0] == "wait" and c[1] == main and c[2] is done[0] for c in direct.calls)
    assert main in direct.copies  # the caller's own share was issued too
