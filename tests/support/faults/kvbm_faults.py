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


# ---------------------------------------------------------------------------- patches
def _patch_mover(module: ModuleType) -> None:
    mover = module.BlockMover
    corrupt, fail = _flag("KVBM_FAULT_CORRUPT_LOADS"), _flag("KVBM_FAULT_FAIL_LOADS")
    delay = _number("KVBM_FAULT_COPY_DELAY_SECS")
    if corrupt or fail:
        from_slots = mover._from_slots

        def faulty_from_slots(self: Any, region: Any, blocks: Any, rows: Any, picks: Any) -> Any:
            done = from_slots(self, region, blocks, rows, picks)
            done.wait()
            for view in region.layer_views:  # CPU regions only (a CUDA region has none)
                view[blocks] = 0
            if fail:
                raise OSError("KVBM_FAULT_FAIL_LOADS: load failed after writing zeros")
            return done

        mover._from_slots = faulty_from_slots
    if delay:
        run = mover.run

        def slow_run(self: Any, batch: Any, region: Any, until: float) -> int:
            time.sleep(delay)
            return int(run(self, batch, region, until))

        mover.run = slow_run


class _DiskFaults:
    """Counts G3 operations across the worker's disk I/O classes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops = 0
        self.eio_after = _number("KVBM_FAULT_DISK_EIO_AFTER")
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


def _patch_disk(module: ModuleType) -> None:
    faults = _DiskFaults()
    if faults.eio_after is None and faults.hang is None and faults.slow_write is None:
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


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "kvbm_worker.mover": _patch_mover,
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
