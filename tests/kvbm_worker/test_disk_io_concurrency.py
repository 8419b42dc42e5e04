"""Disk I/O from the worker's two lanes at once (stores/demotions and loads/promotions)."""
import mmap
import os
import threading

import numpy as np
import pytest

from kvbm_worker.handlers.disk import NixlDiskIO, PosixDiskIO

SLOT = 8192
SLOTS = 64


@pytest.mark.parametrize("kind", ["nixl", "posix"])
def test_two_lanes_concurrently_move_the_right_bytes(tmp_path, kind: str) -> None:
    path = tmp_path / "disk"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, SLOT * SLOTS)
    bufs = [np.frombuffer(mmap.mmap(-1, SLOT * SLOTS), np.uint8).reshape(SLOTS, SLOT) for _ in range(2)]
    if kind == "nixl":
        pytest.importorskip("nixl_cu13")
        io = NixlDiskIO(fd, SLOT * SLOTS, f"test-{os.getpid()}")
    else:
        io = PosixDiskIO(fd)
    for b in bufs:
        io.register(b.ctypes.data, b.nbytes)
    src, dst = bufs
    src[:] = np.random.default_rng(1).integers(0, 256, src.shape, dtype=np.uint8)
    half = SLOTS // 2
    # The reader's half of the file holds known bytes before the race starts.
    io.write([src.ctypes.data + s * SLOT for s in range(half, SLOTS)], [s * SLOT for s in range(half, SLOTS)],
             [SLOT] * half)
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for _ in range(200):
                io.write([src.ctypes.data + s * SLOT for s in range(half)], [s * SLOT for s in range(half)],
                         [SLOT] * half)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(200):
                io.read([dst.ctypes.data + s * SLOT for s in range(half, SLOTS)],
                        [s * SLOT for s in range(half, SLOTS)], [SLOT] * half)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert np.array_equal(dst[half:], src[half:])
    io.read([dst.ctypes.data + s * SLOT for s in range(half)], [s * SLOT for s in range(half)], [SLOT] * half)
    assert np.array_equal(dst[:half], src[:half])
    io.close()
    os.close(fd)
