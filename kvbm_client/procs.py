"""Processes and the files they leave behind: is a pid alive, remove files of dead owners.

Runs in any role. Files named ``<prefix><pid>-...`` belong to process ``pid``; a file whose
owner no longer runs is stale (its process died without cleaning up, e.g. SIGKILL).
"""
from __future__ import annotations

import glob
import logging
import os

log = logging.getLogger("kvbm")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a process of another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_pid(path: str, prefix: str) -> int | None:
    """The pid in a file name ``<prefix><pid>[-...]``, or None when the name has none."""
    name = os.path.basename(path)
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def remove_stale_files(directory: str, prefix: str) -> list[str]:
    """Remove ``directory/<prefix><pid>-*`` files whose process is gone; returns their paths."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(directory), glob.escape(prefix) + "*")):
        pid = owner_pid(path, prefix)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
        log.info("removed stale file %s (pid %d is gone)", path, pid)
    return removed
