"""G3 disk I/O: NIXL's POSIX backend, or aligned preadv/pwritev when NIXL cannot load.

Runs in the worker daemon, on its I/O threads (:mod:`.disk_guard` bounds each call's time;
never on the event loop). Every I/O is a run of whole slots (multiples of 4096 bytes) between
page-aligned host memory and the disk file, so O_DIRECT holds.
"""
from __future__ import annotations

import ctypes
import importlib
import logging
import os
import threading
import time
from typing import Any, Callable, Protocol, Sequence

log = logging.getLogger("kvbm.worker")


class DiskIO(Protocol):
    """Copies between host memory and the G3 file: entry ``i`` moves ``lengths[i]`` bytes
    between host address ``addrs[i]`` and file offset ``offsets[i]``; raises ``OSError``
    (short read or write included) when any entry did not move completely."""

    name: str

    def register(self, address: int, length: int) -> None:
        """Declare host memory that I/O will read or write (pools, bounce buffers)."""

    def write(self, addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> None: ...

    def read(self, addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> None: ...

    def close(self) -> None: ...


class PosixDiskIO:
    """pwritev/preadv, one call per entry."""

    name = "posix-pwritev"

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def register(self, address: int, length: int) -> None:
        pass

    @staticmethod
    def _view(addr: int, length: int) -> memoryview:
        return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")

    def write(self, addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> None:
        for addr, off, n in zip(addrs, offsets, lengths):
            if os.pwritev(self.fd, [self._view(addr, n)], off) != n:
                raise OSError(f"short write at offset {off}")

    def read(self, addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> None:
        for addr, off, n in zip(addrs, offsets, lengths):
            if os.preadv(self.fd, [self._view(addr, n)], off) != n:
                raise OSError(f"short read at offset {off}")

    def close(self) -> None:
        pass


def _load_nixl() -> tuple[Callable[..., Any], Callable[..., Any]]:
    try:
        api = importlib.import_module("nixl_cu13._api")  # the wheel named in the design
    except ImportError:
        api = importlib.import_module("nixl._api")  # the meta package
    return api.nixl_agent, api.nixl_agent_config


class NixlDiskIO:
    """NIXL agent with the POSIX backend; the file is registered once as FILE memory."""

    name = "nixl-posix"
    POLL_SECONDS = 20e-6

    def __init__(self, fd: int, file_bytes: int, agent_name: str) -> None:
        nixl_agent, nixl_agent_config = _load_nixl()
        # NOTE: one transfer at a time per agent. The store and load lanes both do disk I/O; two
        # concurrent transfers on one agent made the POSIX backend fail to submit its io_uring
        # queue and then corrupt the heap (seen in the fault soak: "munmap_chunk(): invalid pointer").
        self._lock = threading.Lock()
        self.fd = fd
        self.agent_name = agent_name
        self.agent = nixl_agent(agent_name, nixl_agent_config(backends=["POSIX"]))
        self._regs = [self.agent.register_memory([(0, file_bytes, fd, "")], "FILE")]

    def register(self, address: int, length: int) -> None:
        self._regs.append(self.agent.register_memory([(address, length, 0, "")], "DRAM"))

    def _xfer(self, op: str, addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> None:
        if not addrs:
            return
        with self._lock:
            try:
                self._xfer_locked(op, addrs, offsets, lengths)
            except OSError:
                raise
            except Exception as exc:  # NIXL's own errors (nixlBackendError on a short read): an I/O error
                raise OSError(f"NIXL POSIX {op} of {len(addrs)} runs failed: {type(exc).__name__}: {exc}") from exc

    def _xfer_locked(self, op: str, addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> None:
        local = self.agent.get_xfer_descs([(a, n, 0) for a, n in zip(addrs, lengths)], "DRAM")
        remote = self.agent.get_xfer_descs([(o, n, self.fd) for o, n in zip(offsets, lengths)], "FILE")
        handle = self.agent.initialize_xfer(op, local, remote, self.agent_name)
        try:
            state = self.agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                time.sleep(self.POLL_SECONDS)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise OSError(f"NIXL POSIX {op} of {len(addrs)} slots failed")
        finally:
            self.agent.release_xfer_handle(handle)

    def write(self, addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> None:
        self._xfer("WRITE", addrs, offsets, lengths)

    def read(self, addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> None:
        self._xfer("READ", addrs, offsets, lengths)

    def close(self) -> None:
        for reg in reversed(self._regs):
            try:
                self.agent.deregister_memory(reg)
            except Exception:  # teardown: keep going
                log.debug("NIXL deregister failed", exc_info=True)
        self._regs.clear()


def open_disk_io(fd: int, file_bytes: int, agent_name: str, prefer_nixl: bool = True) -> DiskIO:
    """NIXL POSIX when it loads, else the preadv/pwritev fallback (logged)."""
    if prefer_nixl:
        try:
            return NixlDiskIO(fd, file_bytes, agent_name)
        except Exception as exc:  # ImportError, missing plugin, backend init failure
            log.warning("NIXL POSIX backend unavailable (%s); disk I/O falls back to preadv/pwritev", exc)
    return PosixDiskIO(fd)
