"""Pinned host memory for GPU copies: CUDA registrations of host ranges, and the run
arithmetic that keeps every DMA inside one registration.

Used by :mod:`.cuda` (the GPU worker's copies); pure numpy except ``PinnedHost.pin``/``close``,
which call the CUDA runtime (imported lazily: this module imports on a machine without CUDA).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import numpy.typing as npt

from ..cuda_region import check, cudart
from ..runs import segments as segments  # re-exported: the merging rule lives in ..runs

log = logging.getLogger("kvbm.worker")
Addrs = npt.NDArray[np.int64]

PIN_CHUNK = 1 << 30  # cudaHostRegister granularity (progress, timeout)


class PinnedHost:
    """Host ranges registered with CUDA (``cudaHostRegister``), chunk by chunk.

    Owns the registrations; ``close()`` unregisters them (before the memory is unmapped).
    NOTE: a DMA never spans two registrations (``chunk_ids`` splits runs), since the driver
    treats a range crossing registrations as pageable.
    """

    def __init__(self, device: int) -> None:
        self.device = device
        self.ranges: list[tuple[int, int]] = []
        self._starts: Addrs = np.zeros(0, np.int64)

    def pin(self, address: int, length: int, chunk: int = PIN_CHUNK,
            progress: Callable[[float], None] | None = None, deadline: float | None = None) -> None:
        rt = cudart()
        check(rt.cudaSetDevice(self.device), "cudaSetDevice")
        done = 0
        while done < length:
            n = min(chunk, length - done)
            check(rt.cudaHostRegister(address + done, n, rt.cudaHostRegisterDefault),
                  f"cudaHostRegister({n} bytes)")
            self.ranges.append((address + done, n))
            done += n
            if progress is not None:
                progress(done / length)
            if deadline is not None and done < length and time.monotonic() > deadline:
                raise TimeoutError(f"pinning stopped at {done / 1e9:.1f} of {length / 1e9:.1f} GB: past the "
                                   "init timeout (DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS)")
        self._starts = np.sort(np.array([r[0] for r in self.ranges], np.int64))

    def chunk_ids(self, addrs: Addrs) -> Addrs:
        return np.searchsorted(self._starts, addrs, side="right").astype(np.int64)

    def split(self, src: Addrs, dst: Addrs, lengths: Addrs, host: Addrs) -> tuple[Addrs, Addrs, Addrs]:
        """Cut runs (``host`` is ``src`` or ``dst``) where they cross from one registration into the next."""
        first = self.chunk_ids(host)
        cross = np.flatnonzero(first != self.chunk_ids(host + lengths - 1))
        if cross.size == 0:
            return src, dst, lengths
        out_s, out_d, out_n = [src[:cross[0]]], [dst[:cross[0]]], [lengths[:cross[0]]]
        for k, i in enumerate(cross.tolist()):
            cuts = [int(c) - int(host[i]) for c in self._starts if host[i] < c < host[i] + lengths[i]]
            edges = np.array([0, *cuts, int(lengths[i])], np.int64)
            out_s.append(src[i] + edges[:-1])
            out_d.append(dst[i] + edges[:-1])
            out_n.append(np.diff(edges))
            nxt = cross[k + 1] if k + 1 < cross.size else len(src)
            out_s.append(src[i + 1:nxt])
            out_d.append(dst[i + 1:nxt])
            out_n.append(lengths[i + 1:nxt])
        return np.concatenate(out_s), np.concatenate(out_d), np.concatenate(out_n)

    def close(self) -> None:
        if not self.ranges:
            return
        rt = cudart()
        rt.cudaSetDevice(self.device)
        for start, _ in reversed(self.ranges):
            err = rt.cudaHostUnregister(start)[0]
            if err != rt.cudaError_t.cudaSuccess:
                log.warning("cudaHostUnregister: %s", getattr(err, "name", err))
        self.ranges = []
