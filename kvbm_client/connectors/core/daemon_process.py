"""The worker daemon's process as the connector's worker side sees it: alive, gone, or killed.

Runs in an engine worker process. Used only when a load got no answer (see the ordering
argument in :mod:`kvbm_client.connectors.core`): the daemon may still be about to write the
engine's blocks, and a copy stops for sure only with its process. The process is learned
from the daemon's unix socket (``SO_PEERCRED`` of a connection: the pid that listens there)
and held by a pidfd, so a pid the kernel reused is never signalled. The socket directory is
ours (checked by :func:`kvbm_client.endpoints.check_socket_dir`), so the daemon runs as our
user and may be signalled. A TCP address (or another pid namespace) gives no process: the
caller then waits for an answer instead.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import socket
import struct
import time

from ...endpoints import is_unix, unix_path

log = logging.getLogger("kvbm.connector")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class DaemonProcess:
    """One worker daemon's process (the one listening at ``address`` when last learned)."""

    def __init__(self, address: str) -> None:
        self.path = unix_path(address) if is_unix(address) else None
        self.pid = 0
        self._fd: int | None = None

    def learn(self) -> None:
        """Hold the process listening at the address now, unless the one held still runs."""
        if self.path is None or (self._fd is not None and not self.gone()):
            return
        self.close()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                s.connect(self.path)
                pid, _, _ = _UCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            if pid > 0:
                self._fd, self.pid = os.pidfd_open(pid), pid
        except OSError as exc:  # not listening (restarting), or no pidfd: nothing held
            log.debug("kvbm: no process found at %s: %s", self.path, exc)

    def gone(self) -> bool:
        """The held process has exited (True when none is held)."""
        return self.wait_gone(0.0)

    def wait_gone(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the held process to exit; True when it has (or
        none is held)."""
        if self._fd is None:
            return True
        end = time.monotonic() + timeout
        while True:
            if select.select([self._fd], [], [], max(0.0, end - time.monotonic()))[0]:
                return True
            if time.monotonic() >= end:
                return False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def kill(self, timeout: float) -> bool:
        """SIGKILL the held process and wait (up to ``timeout``) until it has exited; True
        when it is gone. A killed process moves no byte more, whatever it was doing (even
        stopped: SIGKILL needs no cooperation)."""
        if self._fd is None:
            return False
        if self.gone():
            return True
        try:
            signal.pidfd_send_signal(self._fd, signal.SIGKILL)
        except OSError as exc:
            log.error("kvbm: cannot kill worker daemon pid %d: %s", self.pid, exc)
            return False
        return self.wait_gone(timeout)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self.pid = None, 0
