"""Reading the machine: available memory (cgroup limits included), free space, byte units.

Runs in ``kvbm doctor``; read-only probes of ``/proc``, ``/sys/fs/cgroup`` and ``statvfs``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass


def fmt_bytes(n: float) -> str:
    """``2.25 MiB``, ``6.10 GiB``: binary units, as ``free -h`` and ``df -h`` print them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def gb_at_most(nbytes: float) -> str:
    """``nbytes`` in GB (1e9, as DYN_KVBM_*_GB counts), three significant digits, rounded down
    so that a remedy never suggests more than fits."""
    gb = nbytes / 1e9
    if gb <= 0:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(gb)))
    return f"{math.floor(gb * 10 ** digits) / 10 ** digits:g}"


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def cgroup_memory_free(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's cgroup may still allocate (limit minus usage), None when unlimited.

    NOTE: inside a container ``MemAvailable`` is the host's; the cgroup limit is what the
    OOM killer enforces. cgroup v2 first (``memory.max``), then v1.
    """
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            with open(os.path.join(root, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(root, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 says "unlimited" so
            return None
        return max(0, int(limit) - usage)
    return None


@dataclass(frozen=True)
class Memory:
    """What a new G2 pool can take: the smaller of MemAvailable and the cgroup's headroom."""

    mem_available: int
    cgroup_free: int | None

    @property
    def available(self) -> int:
        return self.mem_available if self.cgroup_free is None else min(self.mem_available, self.cgroup_free)

    @property
    def source(self) -> str:
        if self.cgroup_free is not None and self.cgroup_free < self.mem_available:
            return "cgroup memory limit"
        return "MemAvailable"


def memory() -> Memory:
    return Memory(meminfo().get("MemAvailable", 0), cgroup_memory_free())


def existing_ancestor(path: str) -> str:
    """``path`` itself or its nearest ancestor that exists (where a new directory would land)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path``."""
    st = os.statvfs(existing_ancestor(path))
    return st.f_bavail * st.f_frsize


def total_bytes(path: str) -> int:
    st = os.statvfs(existing_ancestor(path))
    return st.f_blocks * st.f_frsize


def fs_type(path: str, mounts: str = "/proc/self/mounts") -> str:
    """The filesystem type holding ``path`` (``ext4``, ``tmpfs``, ``nfs4``...), "" if unknown."""
    target = os.path.realpath(existing_ancestor(path))
    best, kind = "", ""
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return ""
    return kind
