"""The faults :mod:`sitecustomize` installs in a kvbm worker, one environment variable each.

* ``KVBM_FAULT_CORRUPT_LOADS=1``: every load into a CPU engine region zeroes the engine pages
  it wrote (the negative control: outputs must then differ).
* ``KVBM_FAULT_FAIL_LOADS=1``: the same, then the load fails (``OSError``): the engine must
  recompute those blocks.
* ``KVBM_FAULT_COPY_DELAY_SECS=S``: every copy batch sleeps S seconds on its lane before it
  moves a byte (after the lane's deadline check): lanes back up.
* ``KVBM_FAULT_DISK_EIO_AFTER=N``: every G3 read or write after the first N fails with EIO.
* ``KVBM_FAULT_DISK_HANG_READ_SECS=S``: the first G3 read sleeps S seconds before it runs
  (a disk that hangs, then comes back).
* ``KVBM_FAULT_DISK_SLOW_WRITE_SECS=S``: every G3 write is torn in time: its first half is
  written, then it sleeps S seconds, then it writes the rest (a kill -9 in between leaves a
  slot half old, half new).
* ``KVBM_FAULT_DISK_EIO_EVERY=K``: every K-th G3 read or write fails with EIO (a flaky disk).
* ``KVBM_FAULT_STALL=kind:nth:seconds[,...]``: the nth job of that kind (``store``, ``load``,
  ``demote``, ``promote``; 1-based, counted in this process) sleeps S seconds on its lane
  after the lane's deadline and epoch checks, before its first byte: a copy accepted and
  started in time that then stalls (a stopped process, a preempted thread).
* ``KVBM_FAULT_STALL_COPY=kind:nth:seconds[,...]``: the same, but inside the job's first
  chunk: the copy checked its time, then the bytes move S seconds later (a process stopped
  or frozen mid-copy).
* ``KVBM_FAULT_FAIL=kind:nth[,...]``: the nth job of that kind fails on its lane with EIO
  before it moves a byte.
* ``KVBM_FAULT_GROUP_DELAY_SECS=S``: a load run in layer groups lands each group after the
  first S seconds late (CPU: its bytes are copied late, so the engine's forward must wait for
  the later layers' pages; CUDA: its completion is reported late).
* ``KVBM_FAULT_LAYERS_EARLY=1``: a load run in layer groups reports all its pages landed
  before it copies a byte (a lying daemon: the negative control of the layer waits).
* ``KVBM_FAULT_GO_DELAY_SECS=S``: every leader's go (``StartTransfer``) the worker asks for is
  sent S seconds late (a slow leader: a stage's copy, which does not wait for it, is done first).
* ``KVBM_FAULT_POOLS_READY_DELAY_SECS=S``: a worker whose pools are allocated tells the leader
  (``PoolsReady``) S seconds later (a slow leader link: the pools exist, the leader does not know).
* ``KVBM_FAULT_LOG=PATH``: one line per injected fault is appended there (a test asserts that
  its fault was injected at all).

Patches are applied when the module that defines the target is imported (a meta path hook),
so a process that never imports the worker is untouched.
"""
from __future__ import annotations

import errno
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from types import ModuleType
from typing import Any, Callable, Sequence


def _flag(name: str) -> bool:
    return os.environ.get(name, "") == "1"


def _number(name: str) -> float | None:
    value = os.environ.get(name, "")
    return float(value) if value else None


_log_lock = threading.Lock()


def note(what: str) -> None:
    """Record one injected fault: stderr (the daemon's log) and ``KVBM_FAULT_LOG``."""
    print(f"kvbm_faults: {what}", file=sys.stderr, flush=True)
    path = os.environ.get("KVBM_FAULT_LOG", "")
    if path:
        with _log_lock, open(path, "a") as f:
            f.write(f"{time.time():.3f} {what}\n")


def parse_jobs(spec: str) -> dict[str, dict[int, float]]:
    """``kind:nth[:seconds],...`` -> {kind: {nth: seconds}} (seconds 0 when absent)."""
    jobs: dict[str, dict[int, float]] = {}
    for item in filter(None, spec.split(",")):
        kind, nth, *seconds = item.split(":")
        jobs.setdefault(kind, {})[int(nth)] = float(seconds[0]) if seconds else 0.0
    return jobs


class _JobFaults:
    """Counts jobs per kind on the lanes; stalls or fails the chosen ones."""

    def __init__(self) -> None:
        self.stalls = parse_jobs(os.environ.get("KVBM_FAULT_STALL", ""))
        self.copy_stalls = parse_jobs(os.environ.get("KVBM_FAULT_STALL_COPY", ""))
        self.fails = parse_jobs(os.environ.get("KVBM_FAULT_FAIL", ""))
        self.lock = threading.Lock()
        self.seen: dict[str, int] = {}
        self.current = threading.local()  # the job this lane thread runs: (kind, nth)

    def __bool__(self) -> bool:
        return bool(self.stalls or self.fails or self.copy_stalls)

    def in_chunk(self) -> None:
        """A chunk is about to move (after the copy checked its time)."""
        kind, n = getattr(self.current, "job", ("", 0))
        seconds = self.copy_stalls.get(kind, {}).pop(n, None)
        if seconds:
            note(f"stall {kind} job #{n} inside its first chunk for {seconds:g}s")
            time.sleep(seconds)
            note(f"stall {kind} job #{n}: the chunk moves now")

    def before(self, batch: Any) -> None:
        kind = batch.kind.name.lower()
        with self.lock:
            self.seen[kind] = n = self.seen.get(kind, 0) + 1
        self.current.job = (kind, n)
        seconds = self.stalls.get(kind, {}).get(n)
        if seconds:
            note(f"stall {kind} job #{n} (job id {batch.job_id}, {len(batch.engine_blocks)} engine blocks) "
                 f"for {seconds:g}s")
            time.sleep(seconds)
            note(f"stall {kind} job #{n} copies now")
        if n in self.fails.get(kind, {}):
            note(f"fail {kind} job #{n} (job id {batch.job_id}, {len(batch.engine_blocks)} engine blocks)")
            raise OSError(errno.EIO, f"KVBM_FAULT_FAIL: {kind} job #{n} failed")


# ---------------------------------------------------------------------------- patches
def _patch_mover(module: ModuleType) -> None:
    mover = module.BlockMover
    corrupt, fail = _flag("KVBM_FAULT_CORRUPT_LOADS"), _flag("KVBM_FAULT_FAIL_LOADS")
    delay = _number("KVBM_FAULT_COPY_DELAY_SECS")
    group_delay, early = _number("KVBM_FAULT_GROUP_DELAY_SECS"), _flag("KVBM_FAULT_LAYERS_EARLY")
    if group_delay:
        _delay_groups(mover, group_delay, bytes_late=True)
    if early:
        early_run = mover.run

        def lying_run(self: Any, batch: Any, region: Any, until: float, grouping: Any = None,
                      staged: Any = None) -> int:
            if grouping is not None:
                note(f"layers early: {grouping.bounds[-1]} pages reported landed before the copy")
                grouping.landed(grouping.bounds[-1])
            return int(early_run(self, batch, region, until, grouping, staged))

        mover.run = lying_run
    if corrupt or fail:
        from_slots = mover._from_slots

        def faulty_from_slots(self: Any, region: Any, blocks: Any, rows: Any, picks: Any, pages: Any = None,
                              timed: bool = False) -> Any:
            done = from_slots(self, region, blocks, rows, picks, pages)
            done.wait()
            for view in region.layer_views:  # CPU regions only (a CUDA region has none)
                view[blocks] = 0
            if fail:
                raise OSError("KVBM_FAULT_FAIL_LOADS: load failed after writing zeros")
            return done

        mover._from_slots = faulty_from_slots
    if delay:
        run = mover.run

        def slow_run(self: Any, batch: Any, region: Any, until: float, grouping: Any = None,
                     staged: Any = None) -> int:
            time.sleep(delay)
            return int(run(self, batch, region, until, grouping, staged))

        mover.run = slow_run
    if JOBS:
        inner = mover.run

        def faulty_run(self: Any, batch: Any, region: Any, until: float, grouping: Any = None,
                       staged: Any = None) -> int:
            JOBS.before(batch)
            return int(inner(self, batch, region, until, grouping, staged))

        mover.run = faulty_run
        _patch_chunks(mover)


def _delay_groups(cls: Any, seconds: float, bytes_late: bool) -> None:
    """``KVBM_FAULT_GROUP_DELAY_SECS``: a page group after the first lands ``seconds`` late.
    ``bytes_late`` (the CPU medium, which copies when it is called): its bytes are copied that
    late; else (CUDA, which only enqueues) its completion is reported that late."""
    original = cls._from_slots

    class Late:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def wait(self) -> None:
            time.sleep(seconds)
            self.inner.wait()

        def landed(self) -> bool:
            return False

    def late_groups(self: Any, region: Any, blocks: Any, rows: Any, picks: Any, pages: Any = None,
                    timed: bool = False) -> Any:
        if pages is None or pages[0] == 0:
            return original(self, region, blocks, rows, picks, pages, timed)
        note(f"group delay: pages [{pages[0]}, {pages[1]}) of {len(blocks)} blocks {seconds:g}s late")
        if bytes_late:
            time.sleep(seconds)
            return original(self, region, blocks, rows, picks, pages, timed)
        return Late(original(self, region, blocks, rows, picks, pages, timed))

    cls._from_slots = late_groups


def _patch_chunks(cls: type) -> None:
    """Copy stalls inside a chunk: before the medium moves it (``_to_slots`` / ``_from_slots``)."""
    if not JOBS.copy_stalls:
        return
    for name in ("_to_slots", "_from_slots"):
        original = getattr(cls, name)

        def stalled(self: Any, *args: Any, _original: Callable[..., Any] = original) -> Any:
            JOBS.in_chunk()
            return _original(self, *args)

        setattr(cls, name, stalled)


def _patch_cuda(module: ModuleType) -> None:
    _patch_chunks(module.CudaMover)
    group_delay = _number("KVBM_FAULT_GROUP_DELAY_SECS")
    if group_delay:
        _delay_groups(module.CudaMover, group_delay, bytes_late=False)


class _DiskFaults:
    """Counts G3 operations across the worker's disk I/O classes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops = 0
        self.eio_after = _number("KVBM_FAULT_DISK_EIO_AFTER")
        self.eio_every = int(_number("KVBM_FAULT_DISK_EIO_EVERY") or 0)
        self.hang = _number("KVBM_FAULT_DISK_HANG_READ_SECS")
        self.slow_write = _number("KVBM_FAULT_DISK_SLOW_WRITE_SECS")
        self.hung = False

    def before(self, op: str) -> None:
        with self.lock:
            self.ops += 1
            n = self.ops
            hang = op == "read" and self.hang is not None and not self.hung
            if hang:
                self.hung = True
        if hang:
            time.sleep(self.hang or 0.0)
        if self.eio_after is not None and n > self.eio_after:
            raise OSError(errno.EIO, f"KVBM_FAULT_DISK_EIO_AFTER: G3 {op} #{n} failed")
        if self.eio_every and n % self.eio_every == 0:
            note(f"eio G3 {op} #{n}")
            raise OSError(errno.EIO, f"KVBM_FAULT_DISK_EIO_EVERY: G3 {op} #{n} failed")


def _patch_disk(module: ModuleType) -> None:
    faults = _DiskFaults()
    if faults.eio_after is None and faults.hang is None and faults.slow_write is None and not faults.eio_every:
        return
    for cls in (module.PosixDiskIO, module.NixlDiskIO):
        for op in ("read", "write"):
            _wrap_op(cls, op, faults)


def _wrap_op(cls: type, op: str, faults: _DiskFaults) -> None:
    original: Callable[..., None] = getattr(cls, op)

    def faulty(self: Any, addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> None:
        faults.before(op)
        if op == "write" and faults.slow_write:
            halves = [(a, o, n // 2 // 4096 * 4096) for a, o, n in zip(addrs, offsets, lengths)]
            halves = [h for h in halves if h[2]]  # O_DIRECT: whole pages only
            if halves:
                original(self, [h[0] for h in halves], [h[1] for h in halves], [h[2] for h in halves])
            time.sleep(faults.slow_write)
        original(self, addrs, offsets, lengths)

    setattr(cls, op, faulty)


async def _pause(seconds: float, what: str) -> None:
    """Note a delay fault and sleep it out (on the daemon's event loop)."""
    import asyncio
    note(what)
    await asyncio.sleep(seconds)


def _patch_leader_link(module: ModuleType) -> None:
    delay = _number("KVBM_FAULT_GO_DELAY_SECS")
    if not delay:
        return
    original = module.LeaderLink.start_job

    async def slow_go(self: Any, job: Any) -> float:
        await _pause(delay, f"go delayed {delay} s: job {job.job_id}")
        return await original(self, job)  # type: ignore[no-any-return]

    module.LeaderLink.start_job = slow_go


def _patch_service(module: ModuleType) -> None:
    delay = _number("KVBM_FAULT_POOLS_READY_DELAY_SECS")
    if not delay:
        return
    original = module.WorkerService.apply_pool_plan

    async def slow_report(self: Any, plan: Any) -> Any:
        result = await original(self, plan)  # allocated: the report to the leader follows our return
        await _pause(delay, f"pools ready reported {delay} s late: epoch {plan.epoch}")
        return result

    module.WorkerService.apply_pool_plan = slow_report


JOBS = _JobFaults()
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "kvbm_worker.leader_link": _patch_leader_link,
    "kvbm_worker.service": _patch_service,
    "kvbm_worker.mover": _patch_mover,
    "kvbm_worker.handlers.cuda": _patch_cuda,
    "kvbm_worker.handlers.disk": _patch_disk,
}


# ---------------------------------------------------------------------------- import hook
class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, patch: Callable[[ModuleType], None]) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)
        print(f"kvbm_faults: patched {module.__name__}", file=sys.stderr, flush=True)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


def install() -> None:
    """Patch the worker's modules when they are imported (see the module docstring)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
