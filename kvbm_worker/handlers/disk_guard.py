"""A time limit on every G3 operation: a hung disk fails a job, it never freezes a lane.

Runs in the worker daemon. The lanes call :class:`TimedDiskIO`; each read or write runs on
one of two I/O threads and must finish within ``DYN_KVBM_DISK_IO_TIMEOUT_SECS``.

NOTE: a syscall that never returns cannot be cancelled. When one times out:

* its lane gets :class:`DiskTimeout` at once (the job fails);
* every later operation fails fast with :class:`DiskHung` until the stuck one returns, so no
  job queues behind it and no lane reuses the memory it may still write (a bounce buffer:
  the stuck call holds a reference to it, so unmapping it at close is refused and the
  mapping lives until the call returns);
* the I/O threads are daemon threads: a worker that stops with a call still stuck exits.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Sequence

from .disk import DiskIO

log = logging.getLogger("kvbm.worker")


class DiskHung(OSError):
    """A G3 operation has not returned for longer than the timeout: the disk is not used."""


class DiskTimeout(DiskHung):
    """This G3 operation did not finish within the timeout."""


class _IoThreads:
    """A tiny pool of daemon threads (``concurrent.futures`` joins its threads at exit)."""

    def __init__(self, count: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[None], Callable[[], None]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(count)]
        for t in self._threads:
            t.start()

    def _serve(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            future, fn = item
            del item  # NOTE: hold nothing between calls: fn keeps the memory it addresses alive
            if future.set_running_or_notify_cancel():
                try:
                    fn()
                    future.set_result(None)
                except BaseException as exc:  # handed to the waiting lane
                    future.set_exception(exc)
            del future, fn

    def submit(self, fn: Callable[[], None]) -> "Future[None]":
        future: Future[None] = Future()
        self._jobs.put((future, fn))
        return future

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


class TimedDiskIO:
    """Wraps a :class:`~.disk.DiskIO` (see the module docstring). Owns its I/O threads."""

    def __init__(self, io: DiskIO, timeout: float) -> None:
        self.io, self.timeout = io, timeout
        self.name = io.name
        self._threads = _IoThreads(2, "kvbm-disk-io")
        self._lock = threading.Lock()
        self._stuck: dict["Future[None]", float] = {}  # call -> when it was submitted
        self.timeouts = 0

    def register(self, address: int, length: int) -> None:
        self.io.register(address, length)

    @property
    def hung_for(self) -> float:
        """Seconds the oldest stuck call has been running (0 when none is stuck)."""
        with self._lock:
            return time.monotonic() - min(self._stuck.values()) if self._stuck else 0.0

    def check(self) -> None:
        """Raise :class:`DiskHung` while an operation is stuck (before touching a bounce buffer)."""
        stuck_for = self.hung_for
        if stuck_for:
            raise DiskHung(f"G3 refused: a disk operation has not returned for {stuck_for:.1f}s "
                           f"(DYN_KVBM_DISK_IO_TIMEOUT_SECS={self.timeout:g})")

    def write(self, addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], hold: Any = None) -> None:
        """``hold``: the object owning the host memory (kept alive while the call runs)."""
        self._call("write", self.io.write, addrs, offsets, lengths, hold)

    def read(self, addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], hold: Any = None) -> None:
        self._call("read", self.io.read, addrs, offsets, lengths, hold)

    def _call(self, op: str, fn: Callable[[Sequence[int], Sequence[int], Sequence[int]], None],
              addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], hold: Any) -> None:
        if not addrs:
            return
        self.check()
        started = time.monotonic()

        def run(held: Any = hold) -> None:  # ``held``: a stuck call keeps its memory's owner alive
            fn(addrs, offsets, lengths)

        future = self._threads.submit(run)
        try:
            future.result(self.timeout)
        except FutureTimeout:
            with self._lock:
                self._stuck[future] = started
            future.add_done_callback(self._returned)
            self.timeouts += 1
            log.error("G3 disk %s of %d runs did not return within %gs: failing this job, and every disk job "
                      "until it returns", op, len(addrs), self.timeout)
            raise DiskTimeout(f"G3 disk {op} did not finish within {self.timeout:g}s "
                              "(DYN_KVBM_DISK_IO_TIMEOUT_SECS)") from None

    def _returned(self, future: "Future[None]") -> None:
        with self._lock:
            started = self._stuck.pop(future, time.monotonic())
        log.warning("a stuck G3 disk operation returned after %.1fs; the disk is used again",
                    time.monotonic() - started)

    def close(self) -> None:
        """Stop the I/O threads (a stuck one exits when its call returns) and close the wrapped I/O."""
        self._threads.close()
        if self._stuck:
            log.warning("closing G3 I/O with an operation stuck for %.1fs", self.hung_for)
            return  # NOTE: NIXL would deregister memory a stuck transfer still uses
        self.io.close()
