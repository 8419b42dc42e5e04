"""The time limit on G3 operations: a call that never returns fails its job at the limit,
later calls fail fast until it returns, then the disk is used again."""
from __future__ import annotations

import threading
import time

import pytest

from kvbm_worker.handlers.disk_guard import DiskHung, DiskTimeout, TimedDiskIO


class StuckDisk:
    """A stand-in for a disk whose reads block until the test releases them."""

    name = "stuck"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.reads = self.writes = 0
        self.closed = False

    def register(self, address: int, length: int) -> None:
        pass

    def read(self, addrs, offsets, lengths) -> None:
        self.reads += 1
        self.release.wait(30)

    def write(self, addrs, offsets, lengths) -> None:
        self.writes += 1

    def close(self) -> None:
        self.closed = True


def test_a_hung_read_times_out_then_every_call_fails_fast_until_it_returns():
    disk = StuckDisk()
    io = TimedDiskIO(disk, timeout=0.2)
    start = time.monotonic()
    with pytest.raises(DiskTimeout):
        io.read([0], [0], [4096])
    assert time.monotonic() - start < 5
    assert io.hung_for > 0
    start = time.monotonic()
    with pytest.raises(DiskHung, match="has not returned"):
        io.write([0], [0], [4096])
    assert time.monotonic() - start < 0.1 and disk.writes == 0, "a call queued behind the stuck one"
    disk.release.set()
    deadline = time.monotonic() + 5
    while io.hung_for and time.monotonic() < deadline:
        time.sleep(0.01)
    io.write([0], [0], [4096])
    assert disk.writes == 1 and io.timeouts == 1
    io.close()
    assert disk.closed


def test_close_with_a_stuck_call_leaves_the_wrapped_io_open():
    disk = StuckDisk()
    io = TimedDiskIO(disk, timeout=0.1)
    held = bytearray(16)
    with pytest.raises(DiskTimeout):
        io.read([0], [0], [16], hold=held)
    io.close()
    assert not disk.closed, "closing the I/O while a call may still use its memory"
    disk.release.set()


def test_errors_of_the_call_reach_the_caller():
    class Failing(StuckDisk):
        def write(self, addrs, offsets, lengths) -> None:
            raise OSError(5, "EIO")

    io = TimedDiskIO(Failing(), timeout=1.0)
    with pytest.raises(OSError, match="EIO"):
        io.write([0], [0], [1])
    io.write([], [], [])  # nothing to do: no call
    io.close()
