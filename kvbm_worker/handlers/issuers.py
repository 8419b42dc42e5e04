"""Helper threads that issue shares of one long list of load copies at once, each on its own
stream, so the copy engine is not kept waiting for one thread to issue them.

Runs in the worker daemon, for the load lane's :class:`~.cuda_copier.CudaCopier` (``direct``
mechanism only; ``kvbm-worker --issue-threads``).

Why (2026-11-27, twentieth session, ``benchmarks/issue_threads.py``, ``daemon_layer_loads.py
--layout per-layer``): vLLM 0.26's V2 model runner gives Qwen3 one KV allocation per layer, so no
two pages of a block are adjacent and a 256 MiB piece of a layer-grouped load is ~4096 copies of
64 KiB. The driver spends 0.6-1.1 us of CPU on each (a piece 2.5-4.5 ms), about as long as the
piece's DMA: while the first pieces of a load are issued the copy engine waits (2-8 ms a 20K
load, before its first layer group lands). Two threads issued a 4096-copy piece in 2.5 ms instead
of 3.6-3.7 (H200; a third gave 2.3); in the harness the copy engine's idle time fell from 6.4 to
3.8 ms a 20K load and the warm p50 from 86.3 to 82.5 ms (README, twentieth session). A
cross-layer buffer's pieces (one copy per block) split too once they reach ``min_copies``; their
issue was never the bottleneck. The helper threads are made on the first split call.

Invariants: a split call returns only once every share is issued (or failed); a share's stream
first waits for everything enqueued on the caller's stream before the call, and the caller's
stream then waits for every share, so to whoever uses that stream afterwards (its completion
event, the signal words) the copies are one ordered batch, as if issued by one thread. Every
share's call gives up the interpreter lock (``Direct.batch(release=True)``): the calling thread
issues share 0 meanwhile.
"""
from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import numpy.typing as npt

from .cudart_direct import Direct, RawEvent

Addrs = npt.NDArray[np.int64]
ISSUE_THREADS = 2  # default: the lane and one helper
MAX_ISSUE_THREADS = 8
SPLIT_MIN_COPIES = 512  # a call with fewer copies is issued by the caller alone
MAX_SPLIT_MIN_COPIES = 1 << 20


def _bind(device: int) -> None:
    """A helper thread's CUDA device (events are made on the current one)."""
    import torch
    torch.cuda.set_device(device)


def _cuda_stream(device: int) -> Any:
    import torch
    new_stream: Any = torch.cuda.Stream  # (untyped constructor)
    return new_stream(device=device)


class Issuers:
    """``threads - 1`` helper threads and their streams on ``device``; :meth:`issue` splits a
    copy list among them and the calling thread when it is at least ``min_copies`` long.
    ``make_stream(device)``: a helper's stream (an object with ``cuda_stream`` and
    ``synchronize()``; torch's by default); ``bind(device)``: run first on each helper thread."""

    def __init__(self, direct: Direct, device: int, threads: int = ISSUE_THREADS,
                 min_copies: int = SPLIT_MIN_COPIES, make_stream: Callable[[int], Any] = _cuda_stream,
                 bind: Callable[[int], object] | None = _bind) -> None:
        if not 1 <= threads <= MAX_ISSUE_THREADS or min_copies < threads:
            raise ValueError(f"threads must be in [1, {MAX_ISSUE_THREADS}] and min_copies >= threads, "
                             f"not {threads} and {min_copies}")
        self.direct, self.threads, self.min_copies = direct, threads, min_copies
        self._streams = [make_stream(device) for _ in range(threads - 1)]
        self._pool = None if threads == 1 else \
            ThreadPoolExecutor(threads - 1, "kvbm-issue", functools.partial(bind, device) if bind else None)

    def splits(self, copies: int) -> bool:
        return self._pool is not None and copies >= self.min_copies

    def issue(self, dst: Addrs, src: Addrs, lengths: Addrs, stream: int) -> None:
        """Issue ``src[i] -> dst[i]`` as :meth:`Direct.batch` would on the stream handle ``stream``,
        in ``threads`` contiguous shares at once (see the module's invariants)."""
        assert self._pool is not None, "issue() without helper threads"
        cuts = np.linspace(0, len(src), self.threads + 1).astype(np.int64)
        before = self.direct.event()
        before.record(stream)
        futures: list[Future[RawEvent]] = [
            self._pool.submit(self._share, h, before, dst[a:b], src[a:b], lengths[a:b])
            for h, (a, b) in enumerate(zip(cuts[1:-1], cuts[2:]))]
        failure: BaseException | None = None
        try:
            self.direct.batch(dst[:cuts[1]], src[:cuts[1]], lengths[:cuts[1]], stream, release=True)
        except BaseException as exc:  # (every share is still waited for, then this is raised)
            failure = exc
        for future in futures:
            try:
                self.direct.wait(stream, future.result())
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def _share(self, helper: int, before: RawEvent, dst: Addrs, src: Addrs, lengths: Addrs) -> RawEvent:
        handle = self._streams[helper].cuda_stream
        self.direct.wait(handle, before)
        self.direct.batch(dst, src, lengths, handle, release=True)
        done = self.direct.event()
        done.record(handle)
        return done


    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for s in self._streams:
            s.synchronize()
