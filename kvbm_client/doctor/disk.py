"""Checks of the G3 directory: writable, fallocate, O_DIRECT, and (``--bench-disk``) throughput.

Runs in ``kvbm doctor``. Each probe works on its own ``kvbm-doctor-*`` file in
``DYN_KVBM_DISK_CACHE_DIR`` and removes it; a directory the probe had to create is removed
again, so the node finds the disk as it was. The probes replay what a worker does when it
sizes its G3 file (``kvbm_worker/pools.py``): open with O_DIRECT unless disabled, then
``posix_fallocate``, or write zeros with ``DYN_KVBM_DISK_ZEROFILL_FALLBACK``.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import tempfile
import time
from typing import Iterator

from . import machine
from .base import Check, CheckResult, DoctorContext, fail, info, ok, skip, warn

PROBE_PREFIX = "kvbm-doctor-"
PROBE_BYTES = 1 << 20
ALIGN = 4096
BENCH_CHUNK = 16 << 20
BENCH_MAX_BYTES = 1 << 30
BENCH_SECONDS = 1.5
_TMPFS = {"tmpfs", "ramfs"}


@contextlib.contextmanager
def prepared_dir(directory: str) -> Iterator[str]:
    """``directory``, created (0700 like the worker would) if missing and removed again after."""
    created = []
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        created.append(path)
        path = os.path.dirname(path)
    for new in reversed(created):
        os.mkdir(new, 0o700)
    try:
        yield directory
    finally:
        for new in created:
            with contextlib.suppress(OSError):
                os.rmdir(new)


@contextlib.contextmanager
def probe_file(directory: str, flags: int = 0) -> Iterator[int]:
    """A new empty ``kvbm-doctor-*`` file in ``directory``, opened ``O_RDWR | flags``; removed after."""
    fd, path = tempfile.mkstemp(prefix=f"{PROBE_PREFIX}{os.getpid()}-", dir=directory)
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR | flags)
        try:
            yield fd
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, as O_DIRECT wants it."""
    return mmap.mmap(-1, nbytes)


def _disk_dir(ctx: DoctorContext) -> str | None:
    return ctx.cfg.disk_cache_dir if ctx.cfg.disk_enabled else None


def check_dir(ctx: DoctorContext) -> CheckResult:
    """DYN_KVBM_DISK_CACHE_DIR is a directory (or can be created) and a file can be written there."""
    directory = _disk_dir(ctx)
    if directory is None:
        return skip("no G3 configured")
    if os.path.exists(directory) and not os.path.isdir(directory):
        return fail(f"{directory} exists and is not a directory",
                    "point DYN_KVBM_DISK_CACHE_DIR at a directory")
    existed = os.path.isdir(directory)
    try:
        with prepared_dir(directory), probe_file(directory) as fd:
            os.write(fd, b"\0" * ALIGN)
            os.fsync(fd)
    except OSError as exc:
        return fail(f"cannot write in {directory}: {exc.strerror} (errno {exc.errno})",
                    "mount it read-write and make it writable by the worker's user, or point "
                    "DYN_KVBM_DISK_CACHE_DIR at a writable directory")
    kind = machine.fs_type(directory)
    where = f"{directory} ({kind or 'unknown fs'})"
    state = "writable" if existed else "does not exist yet; can be created (the worker does) and written"
    if kind in _TMPFS:
        return warn(f"{where} {state}, but it is in RAM: G3 there takes memory, not disk",
                    "point DYN_KVBM_DISK_CACHE_DIR at a local NVMe/SSD filesystem", fs=kind, existed=existed)
    return ok(f"{where} {state}", fs=kind, existed=existed)


def o_direct_works(directory: str) -> tuple[bool, OSError | None]:
    """Open with O_DIRECT, write and read back one aligned page. (works, the error if not)."""
    page = aligned_buffer(ALIGN)
    page.write(os.urandom(ALIGN))
    back = aligned_buffer(ALIGN)
    try:
        with probe_file(directory, os.O_DIRECT) as fd:
            os.pwritev(fd, [page], 0)
            os.preadv(fd, [back], 0)
    except OSError as exc:
        return False, exc
    return page[:] == back[:], None


def check_o_direct(ctx: DoctorContext) -> CheckResult:
    """The G3 filesystem accepts O_DIRECT (else the worker must be told not to use it)."""
    directory = _disk_dir(ctx)
    if directory is None:
        return skip("no G3 configured")
    disabled = ctx.cfg.disk_disable_o_direct
    try:
        with prepared_dir(directory):
            works, error = o_direct_works(directory)
    except OSError as exc:
        return skip(f"{directory} not usable ({exc.strerror}); see disk.dir")
    kind = machine.fs_type(directory) or "this filesystem"
    if works:
        if disabled:
            return warn(f"O_DIRECT works on {kind} but DYN_KVBM_DISK_DISABLE_O_DIRECT=true: G3 I/O goes "
                        "through the page cache, which competes with G2 for RAM",
                        "unset DYN_KVBM_DISK_DISABLE_O_DIRECT", o_direct=True)
        return ok(f"O_DIRECT write and read back on {kind}", o_direct=True)
    why = f"{error.strerror} (errno {error.errno})" if error else "read back other bytes"
    if disabled:
        return ok(f"{kind} refuses O_DIRECT ({why}); DYN_KVBM_DISK_DISABLE_O_DIRECT=true is set", o_direct=False)
    return fail(f"{kind} refuses O_DIRECT ({why}): the worker cannot open its G3 file",
                "export DYN_KVBM_DISK_DISABLE_O_DIRECT=true", o_direct=False)


def _raw_fallocate(fd: int, nbytes: int) -> int:
    """fallocate(2) itself, without glibc's emulation: 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return 0 if libc.fallocate(fd, 0, 0, nbytes) == 0 else ctypes.get_errno()


def _worker_sizing(directory: str, o_direct: bool) -> OSError | None:
    """What a worker does to size its G3 file: ``posix_fallocate`` on its (O_DIRECT) fd."""
    try:
        with probe_file(directory, os.O_DIRECT if o_direct else 0) as fd:
            os.posix_fallocate(fd, 0, PROBE_BYTES)
    except OSError as exc:
        return exc
    return None


def check_fallocate(ctx: DoctorContext) -> CheckResult:
    """The worker can size its G3 file: fallocate(2), or glibc's emulation, or zero-filling."""
    directory = _disk_dir(ctx)
    if directory is None:
        return skip("no G3 configured")
    cfg = ctx.cfg
    try:
        with prepared_dir(directory):
            with probe_file(directory) as fd:
                raw = _raw_fallocate(fd, PROBE_BYTES)
            o_direct = not cfg.disk_disable_o_direct and o_direct_works(directory)[0]
            sized = _worker_sizing(directory, o_direct) if raw == errno.EOPNOTSUPP else None
    except OSError as exc:
        return skip(f"{directory} not usable ({exc.strerror}); see disk.dir")
    kind = machine.fs_type(directory) or "this filesystem"
    if raw == 0:
        return ok(f"fallocate(2) works on {kind}", fallocate=True)
    if raw != errno.EOPNOTSUPP:
        return fail(f"fallocate(2) fails on {kind}: {os.strerror(raw)} (errno {raw})",
                    "free space on that filesystem or point DYN_KVBM_DISK_CACHE_DIR elsewhere", fallocate=False)
    if cfg.disk_zerofill_fallback:
        return warn(f"{kind} has no fallocate(2); DYN_KVBM_DISK_ZEROFILL_FALLBACK=true: workers write G3's "
                    "size in zeros at start", "expect a slow start; raise DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS "
                    "if the workers time out", fallocate=False)
    if sized is None:
        return warn(f"{kind} has no fallocate(2); glibc emulates it by writing every 4 KiB block, "
                    "so sizing a large G3 is slow", "raise DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS if the "
                    "workers time out, or put G3 on ext4/xfs", fallocate=False)
    return fail(f"{kind} has no fallocate(2) and posix_fallocate on the worker's "
                f"{'O_DIRECT ' if o_direct else ''}file fails: {sized.strerror} (errno {sized.errno})",
                "export DYN_KVBM_DISK_ZEROFILL_FALLBACK=true", fallocate=False)


def _bench(fd: int, total: int, buf: mmap.mmap, write: bool) -> tuple[int, float]:
    """Sequential whole-chunk I/O for up to :data:`BENCH_SECONDS`; (bytes, seconds)."""
    done, start = 0, time.perf_counter()
    while done < total and time.perf_counter() - start < BENCH_SECONDS:
        n = (os.pwritev if write else os.preadv)(fd, [buf], done)
        if n <= 0:
            break
        done += n
    if write:
        os.fsync(fd)
    return done, time.perf_counter() - start


def check_bench(ctx: DoctorContext) -> CheckResult:
    """``--bench-disk``: sequential write then read throughput of the G3 directory (16 MiB I/Os)."""
    directory = _disk_dir(ctx)
    if directory is None:
        return skip("no G3 configured")
    total = min(BENCH_MAX_BYTES, machine.free_bytes(directory) // 4) // BENCH_CHUNK * BENCH_CHUNK
    if total == 0:
        return skip(f"too little free space in {directory} for a benchmark")
    buf = aligned_buffer(BENCH_CHUNK)
    buf.write(os.urandom(BENCH_CHUNK))
    try:
        with prepared_dir(directory):
            o_direct = not ctx.cfg.disk_disable_o_direct and o_direct_works(directory)[0]
            with probe_file(directory, os.O_DIRECT if o_direct else 0) as fd:
                wrote, wsec = _bench(fd, total, buf, write=True)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # reads must come from the disk
                read, rsec = _bench(fd, wrote, buf, write=False)
    except OSError as exc:
        return fail(f"benchmark I/O failed: {exc.strerror} (errno {exc.errno})",
                    "check the disk (dmesg) and DYN_KVBM_DISK_CACHE_DIR")
    wr, rd = wrote / wsec / 1e9, read / rsec / 1e9
    mode = "O_DIRECT" if o_direct else "buffered"
    return info(f"write {wr:.2f} GB/s, read {rd:.2f} GB/s ({mode}, {machine.fmt_bytes(wrote)} in 16 MiB I/Os)",
                write_gbps=round(wr, 3), read_gbps=round(rd, 3), bytes=wrote, o_direct=o_direct)


CHECKS = (
    Check("disk", "dir", check_dir),
    Check("disk", "o_direct", check_o_direct),
    Check("disk", "fallocate", check_fallocate),
    Check("disk", "bench", check_bench, option="bench_disk"),
)
