"""Test-only launcher: kvbm's worker daemon with faults injected into its copies.

    python tests/stress/faulty_worker.py [kvbm-worker arguments]

Imports the real daemon, patches what its environment asks for, then runs
``kvbm_worker.daemon.main``. Nothing is patched without these variables:

* ``KVBM_STRESS_DISK_EIO`` — the G3 file "returns EIO": ``after=N`` (every disk operation
  after the first N), ``p=0.1`` (each operation with probability p), ``every=K`` (every
  K-th). Extra keys: ``ops=read|write|both`` (default both), ``seed=S``. An operation is
  one ``read``/``write`` call of the worker's ``DiskIO`` (NIXL POSIX or preadv/pwritev),
  which raises ``OSError(EIO)`` before touching the file.
* ``KVBM_STRESS_STALL`` — copies that take long, as on a stalled disk or a preempted
  thread: ``kind:nth:seconds[,...]`` with kind ``store``, ``load``, ``demote`` or
  ``promote``; the nth job of that kind (1-based, counted in this process) sleeps
  ``seconds`` on its lane thread before it copies (the job was accepted in time).
* ``KVBM_STRESS_FAIL`` — copies that fail: ``kind:nth[,...]``; the nth job of that kind
  raises ``OSError(EIO)`` on its lane before it copies (the job fails, its callers get ABORTED).
* ``KVBM_STRESS_FAULT_LOG`` — a file that gets one line per injected fault.

The stall and fail hooks wrap ``TransferEngine.run``; the GPU engine (``CudaTransferEngine``)
overrides ``run``, so on a GPU worker only the disk hook applies (the stalls need a CUDA variant).

Runs in the worker daemon's process; the hooks run on its lane threads.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import sys
import threading
import time

log = logging.getLogger("kvbm.worker")
_lock = threading.Lock()


def note(what: str) -> None:
    """One line per injected fault, to the log and to ``KVBM_STRESS_FAULT_LOG``."""
    log.warning("stress fault: %s", what)
    path = os.environ.get("KVBM_STRESS_FAULT_LOG")
    if path:
        with _lock, open(path, "a") as f:
            f.write(f"{time.time():.3f} {what}\n")


def parse_kv(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",") if part)


class EioPolicy:
    """Decides which disk operations fail."""

    def __init__(self, spec: str) -> None:
        kv = parse_kv(spec)
        self.after = int(kv["after"]) if "after" in kv else None
        self.p = float(kv.get("p", 0.0))
        self.every = int(kv.get("every", 0))
        self.ops = kv.get("ops", "both")
        self.rnd = random.Random(int(kv.get("seed", 0)))
        self.count = 0

    def fails(self, op: str) -> bool:
        if self.ops not in ("both", op):
            return False
        with _lock:
            self.count += 1
            n = self.count
            if self.after is not None and n > self.after:
                return True
            if self.every and n % self.every == 0:
                return True
            return self.p > 0 and self.rnd.random() < self.p


class FaultyDiskIO:
    """A ``DiskIO`` whose operations fail with EIO as ``policy`` says."""

    def __init__(self, inner, policy: EioPolicy) -> None:
        self.inner, self.policy = inner, policy
        self.name = f"{inner.name}+eio"

    def register(self, address: int, length: int) -> None:
        self.inner.register(address, length)

    def _check(self, op: str, slots: int) -> None:
        if self.policy.fails(op):
            note(f"eio {op} of {slots} slots")
            raise OSError(errno.EIO, f"injected EIO on disk {op}")

    def write(self, addrs, offsets, length) -> None:
        self._check("write", len(addrs))
        self.inner.write(addrs, offsets, length)

    def read(self, addrs, offsets, length) -> None:
        self._check("read", len(addrs))
        self.inner.read(addrs, offsets, length)

    def close(self) -> None:
        self.inner.close()


def parse_jobs(spec: str) -> dict[str, dict[int, float]]:
    """``kind:nth[:seconds],...`` -> {kind: {nth: seconds}} (seconds 0 when absent)."""
    jobs: dict[str, dict[int, float]] = {}
    for item in filter(None, spec.split(",")):
        kind, nth, *seconds = item.split(":")
        jobs.setdefault(kind, {})[int(nth)] = float(seconds[0]) if seconds else 0.0
    return jobs


def install() -> None:
    """Patch the daemon's modules as the environment asks."""
    import kvbm_worker.daemon as daemon
    import kvbm_worker.transfers as transfers

    eio = os.environ.get("KVBM_STRESS_DISK_EIO", "")
    if eio:
        policy = EioPolicy(eio)
        real_open = daemon.open_disk_io

        def open_disk_io(*args, **kwargs):
            return FaultyDiskIO(real_open(*args, **kwargs), policy)

        daemon.open_disk_io = open_disk_io
    stalls = parse_jobs(os.environ.get("KVBM_STRESS_STALL", ""))
    fails = parse_jobs(os.environ.get("KVBM_STRESS_FAIL", ""))
    if stalls or fails:
        real_run = transfers.TransferEngine.run
        seen: dict[str, int] = {}

        def run(self, batch, region):
            kind = batch.kind.name.lower()
            with _lock:
                seen[kind] = n = seen.get(kind, 0) + 1
            seconds = stalls.get(kind, {}).get(n)
            if seconds:
                note(f"stall {kind} job #{n} ({len(batch.engine_blocks)} engine blocks) for {seconds:g}s")
                time.sleep(seconds)
                note(f"stall {kind} job #{n} copies now")
            if n in fails.get(kind, {}):
                note(f"fail {kind} job #{n} ({len(batch.engine_blocks)} engine blocks)")
                raise OSError(errno.EIO, f"injected failure of {kind} job #{n}")
            return real_run(self, batch, region)

        transfers.TransferEngine.run = run


def main() -> int:
    install()
    from kvbm_worker.daemon import main as worker_main
    return worker_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
