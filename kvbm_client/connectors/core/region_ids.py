"""How an engine's scheduler side learns the region ids its worker side registered.

A region id is a capability (whoever holds it may transfer into the engine's memory), so no
worker shows it; but the scheduler side starts early loads (:mod:`.early_loads`) and must name
the region. vLLM runs the two sides in one process (one rank: ``UniProcExecutor``) or the
worker side in child processes of the scheduler's (``MultiprocExecutor``); both know the
engine's ``kv_transfer_config.engine_id``.

The worker side writes each region id to ``<socket dir>/engines/<sha256(engine_id)>/region-
<pid>-<sha256(worker_id)>`` (directories 0700 and ours, checked like the socket directory;
files 0600, written whole then renamed). The scheduler side reads the file of its worker id
and believes it only when the writer pid is its own process or a descendant (``/proc``), so a
second engine given the same engine_id, or a stale file of a dead engine, is never read.

Runs in the engine's processes (both sides), on their threads; plain file I/O, no daemon.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import secrets
import stat

from ...endpoints import ensure_socket_dir
from ...procs import owner_pid, pid_alive

log = logging.getLogger("kvbm.connector")

PREFIX = "region-"
#: how many generations up a worker process may be from its scheduler (child, or a grandchild
#: under a fork server)
MAX_ANCESTRY = 3


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class EngineRegionIds:
    """The region ids of one engine, shared by its scheduler and worker sides (see the module
    docstring)."""

    def __init__(self, socket_dir: str, engine_id: str) -> None:
        self.root = os.path.join(socket_dir, "engines")
        self.directory = os.path.join(self.root, _key(engine_id))

    def _path(self, worker_id: str, pid: int) -> str:
        return os.path.join(self.directory, f"{PREFIX}{pid}-{_key(worker_id)}")

    # ------------------------------------------------------------------ worker side
    def publish(self, worker_id: str, region_id: str) -> None:
        """Record this process's region on ``worker_id`` (replacing the previous one)."""
        ensure_socket_dir(self.root)
        ensure_socket_dir(self.directory)
        self._sweep()
        tmp = os.path.join(self.directory, f".tmp-{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, json.dumps({"worker_id": worker_id, "region_id": region_id}).encode())
        finally:
            os.close(fd)
        os.replace(tmp, self._path(worker_id, os.getpid()))

    def withdraw(self, worker_id: str) -> None:
        """Remove this process's record for ``worker_id`` (and the directory once empty)."""
        try:
            os.unlink(self._path(worker_id, os.getpid()))
            os.rmdir(self.directory)
        except OSError:
            pass

    def _sweep(self) -> None:
        """Remove records of dead processes, and empty directories of other engines."""
        for path in glob.glob(os.path.join(glob.escape(self.root), "*", PREFIX + "*")):
            pid = owner_pid(path, PREFIX)
            if pid is not None and not pid_alive(pid):
                try:
                    os.unlink(path)
                    os.rmdir(os.path.dirname(path))
                except OSError:
                    pass

    # ------------------------------------------------------------------ scheduler side
    def lookup(self, worker_id: str) -> str | None:
        """The region id this engine's worker side registered on ``worker_id``, or None."""
        pattern = os.path.join(glob.escape(self.directory), f"{PREFIX}*-{_key(worker_id)}")
        for path in sorted(glob.glob(pattern), key=_mtime, reverse=True):
            pid = owner_pid(path, PREFIX)
            if pid is None or not _descends_from(pid, os.getpid()):
                continue
            record = _read_private(path)
            if record is not None and record.get("worker_id") == worker_id:
                return str(record["region_id"])
        return None


def _mtime(path: str) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _read_private(path: str) -> dict[str, str] | None:
    """A record written by our user and readable by nobody else, or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            log.warning("kvbm: ignoring %s (not a private file of ours)", path)
            return None
        data = json.loads(os.read(fd, 4096))
        return data if isinstance(data, dict) else None
    except ValueError:
        return None
    finally:
        os.close(fd)


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants within :data:`MAX_ANCESTRY`."""
    for _ in range(MAX_ANCESTRY + 1):
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat_line = f.read()
        except OSError:
            return False
        # NOTE: the command name (field 2) may hold spaces or ')'; the ppid follows the last ')'.
        pid = int(stat_line[stat_line.rindex(b")") + 2:].split()[1])
    return False
