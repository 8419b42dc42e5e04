"""The engine's KV cache as the worker sees it: buffers it mapped and where each
(layer, block) page lives in them.

Runs in the worker daemon. Page (layer, block) is ``page_bytes`` long at
``buffers[layer.buffer_index] + layer.offset_bytes + block * layer.block_stride_bytes``. Registration checks
that every page of every layer lies inside its buffer, so no later transfer can address
memory outside what the engine handed over.

Media: a CPU engine's buffers are **sealed memfds** handed over the region socket
(SCM_RIGHTS, :mod:`.region_socket`); the worker maps the fd it received and never opens a
path, so it can only ever map memory its client could map itself. CUDA IPC import belongs to
``cuda_region.py`` (GPU data path).

Every request first passes :func:`check_request` (sizes and names within the configured
limits), before any fd is looked at or any memory mapped.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import secrets
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import grpc
import numpy as np
import numpy.typing as npt

from kvbm_client.config import KvbmConfig
from kvbm_client.contract import pb
from kvbm_client.regions import LayerSpec
from kvbm_client.security import region_digest

from .errors import JobFailed
from .id_arrays import EngineBlocks

if TYPE_CHECKING:
    from .signals import SignalPage

#: a region id is a capability (whoever holds it may transfer into the region): 128 random bits
REGION_ID_BYTES = 16


def new_region_id() -> str:
    return "region-" + secrets.token_hex(REGION_ID_BYTES)


class RegionError(ValueError):
    """The registration request does not describe memory the worker can safely address."""


@dataclass(frozen=True, slots=True)
class Peer:
    """The process at the other end of the region socket (SO_PEERCRED): a region's owner."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True, slots=True)
class RegionShape:
    """What every region of one worker shares (its pools' slot layout); ``num_blocks`` may differ."""

    num_layers: int
    page_bytes: int
    dtype: str

    def __str__(self) -> str:
        return f"{self.num_layers} layers x {self.page_bytes} bytes per page, {self.dtype}"


@dataclass(frozen=True, slots=True)
class RegionLimits:
    """How much one registration may describe (``DYN_KVBM_MAX_REGION_*``, ``_MAX_NAME_BYTES``)
    and how many regions a worker holds (``DYN_KVBM_MAX_REGIONS``)."""

    max_pages: int = 8192  # layer placements (one per layer, or per K and V)
    max_buffers: int = 64
    max_name_bytes: int = 256
    max_regions: int = 8

    @classmethod
    def of(cls, config: KvbmConfig) -> "RegionLimits":
        return cls(config.max_region_pages, config.max_region_buffers, config.max_name_bytes, config.max_regions)

    @property
    def max_request_bytes(self) -> int:
        """Longest serialized request within the limits (a placement < 40 bytes, a buffer < 128)."""
        return 4096 + 2 * self.max_name_bytes + 40 * self.max_pages + 128 * self.max_buffers


def check_request(request: "pb.RegisterRegionRequest", limits: RegionLimits) -> None:
    """Raise :class:`RegionError` if the request exceeds ``limits`` (pure; nothing is opened)."""
    if len(request.engine_id.encode()) > limits.max_name_bytes:
        raise RegionError(f"engine_id of {len(request.engine_id.encode())} bytes; at most {limits.max_name_bytes} "
                          "(DYN_KVBM_MAX_NAME_BYTES)")
    if len(request.layers) > limits.max_pages:
        raise RegionError(f"{len(request.layers)} layer placements; at most {limits.max_pages} "
                          "(DYN_KVBM_MAX_REGION_PAGES)")
    if len(request.buffers) > limits.max_buffers:
        raise RegionError(f"{len(request.buffers)} buffers; at most {limits.max_buffers} "
                          "(DYN_KVBM_MAX_REGION_BUFFERS)")


def check_sealed_memfd(index: int, fd: int) -> int:
    """The size of ``fd`` if it is a memfd sealed against shrinking, else :class:`RegionError`.

    NOTE: F_SEAL_SHRINK is what makes a region safe to copy into from a lane thread: without
    it the owner could truncate the file under the mapping and the copy would die of SIGBUS.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"buffer {index}: the fd is not a memory file (mode {stat.S_IFMT(st.st_mode):o}); "
                          "only sealed memfds are mapped")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise RegionError(f"buffer {index}: the fd is a regular file, not a memfd; only sealed memfds are "
                          "mapped (memfd_create with MFD_ALLOW_SEALING, then F_ADD_SEALS F_SEAL_SHRINK)") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise RegionError(f"buffer {index}: the memfd is not sealed against shrinking (seals {seals:#x}); add "
                          "F_SEAL_SHRINK (fcntl F_ADD_SEALS) before registering: a truncation would fault the worker")
    return int(st.st_size)


class EngineRegion:
    """A CPU engine's KV cache, mapped from the sealed memfds it handed over.

    Owns its mappings (``close()`` unmaps). Invariants: every page of every layer lies inside
    its buffer (checked at registration, before the region is usable); no copy touches the
    region after :meth:`retire` returned (copies hold it with :meth:`use`).
    """

    def __init__(self, request: "pb.RegisterRegionRequest", fds: Sequence[int], owner: Peer) -> None:
        self._init_common(request, owner)
        self._validate_shape(request)
        self._maps: list[mmap.mmap] = []
        self.buffers: list[npt.NDArray[np.uint8]] = []
        self.layer_views: list[npt.NDArray[np.uint8]] = []
        try:
            whole = self._map_fds(request, fds)
            for i, buf in enumerate(request.buffers):
                self.buffers.append(whole[buf.fd_index][buf.offset_bytes:buf.offset_bytes + buf.size_bytes])
            self._validate_bounds()
            self.layer_views = [
                np.lib.stride_tricks.as_strided(self.buffers[ls.buffer_index][ls.offset_bytes:],
                                                shape=(self.num_blocks, self.page_bytes), strides=(ls.block_stride_bytes, 1))
                for ls in self.layers]
        except BaseException:
            self.close()
            raise

    def _init_common(self, request: "pb.RegisterRegionRequest", owner: Peer) -> None:
        """What every region kind sets first (the CUDA region shares it)."""
        self.region_id = new_region_id()
        self.engine_id = request.engine_id
        self.owner = owner
        self.page_bytes = int(request.page_bytes)
        self.num_blocks = int(request.num_blocks)
        self.dtype = request.dtype
        self.layers = [LayerSpec(lp.buffer_index, lp.offset_bytes, lp.block_stride_bytes) for lp in request.layers]
        self.retired = False
        self._users = 0
        self._unused: asyncio.Event | None = None
        #: the engine's signal page (``RegisterRegionRequest.signals``), if it sent one
        self.signals: SignalPage | None = None

    def attach_signals(self, page: "SignalPage") -> None:
        """Keep the engine's signal page (closed with the region). The CPU medium stores its
        words from the CPU; a GPU region also registers it with CUDA."""
        self.signals = page

    def _close_signals(self) -> None:
        if self.signals is not None:
            self.signals.close()
            self.signals = None

    @property
    def pid(self) -> int:
        return self.owner.pid

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.page_bytes

    @property
    def shape(self) -> RegionShape:
        return RegionShape(self.num_layers, self.page_bytes, self.dtype)

    def check_blocks(self, blocks: EngineBlocks) -> None:
        """Defence in depth before a copy: every engine block id lies in the region."""
        if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= self.num_blocks):
            raise ValueError(f"engine blocks {int(blocks.min())}..{int(blocks.max())} outside "
                             f"0..{self.num_blocks - 1}")

    # ------------------------------------------------------------------ lifetime (event loop)
    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Hold the region for one job's copy; raises :class:`JobFailed` (NOT_FOUND) once it
        was unregistered."""
        if self.retired:
            raise JobFailed(grpc.StatusCode.NOT_FOUND, f"region {region_digest(self.region_id)} was unregistered")
        self._users += 1
        try:
            yield
        finally:
            self._users -= 1
            if self._users == 0 and self._unused is not None:
                self._unused.set()

    async def retire(self) -> None:
        """Refuse new copies and wait for those holding the region (then :meth:`close` it)."""
        self.retired = True
        while self._users:
            self._unused = asyncio.Event()
            await self._unused.wait()

    # ------------------------------------------------------------------ checks
    def _validate_shape(self, request: "pb.RegisterRegionRequest") -> None:
        if not request.buffers:
            raise RegionError("no buffers")
        if not self.layers:
            raise RegionError("no layers")
        if self.page_bytes <= 0 or self.num_blocks <= 0:
            raise RegionError("page_bytes and num_blocks must be > 0")
        for i, ls in enumerate(self.layers):
            if ls.buffer_index >= len(request.buffers):
                raise RegionError(f"layer {i} names buffer {ls.buffer_index}; only {len(request.buffers)} given")
            if self.num_blocks > 1 and ls.block_stride_bytes < self.page_bytes:
                raise RegionError(f"layer {i}: block stride {ls.block_stride_bytes} < page_bytes {self.page_bytes} "
                                  "(pages would overlap)")

    def _map_fds(self, request: "pb.RegisterRegionRequest", fds: Sequence[int]) -> list[npt.NDArray[np.uint8]]:
        """Map each fd once (as far as its buffers reach); buffer ``i`` is a view of fd ``fd_index``."""
        ends = [0] * len(fds)
        for i, buf in enumerate(request.buffers):
            kind = buf.WhichOneof("handle")
            if kind != "fd_index":
                raise RegionError(f"buffer {i}: {kind or 'no handle'} is not served by a CPU worker (a CPU engine "
                                  "hands sealed memfds over the region socket; CUDA IPC needs a GPU worker)")
            if buf.fd_index >= len(fds):
                raise RegionError(f"buffer {i} names fd {buf.fd_index}; {len(fds)} fds came with the request")
            if buf.size_bytes == 0:
                raise RegionError(f"buffer {i}: size_bytes is 0")
            ends[buf.fd_index] = max(ends[buf.fd_index], buf.offset_bytes + buf.size_bytes)
        if not all(ends):
            raise RegionError(f"{len(fds)} fds came with the request; buffers name only "
                              f"{sorted(i for i, e in enumerate(ends) if e)}")
        mapped = []
        for index, (fd, end) in enumerate(zip(fds, ends)):
            size = check_sealed_memfd(index, fd)
            if end > size:
                raise RegionError(f"fd {index}: the memfd has {size} bytes; its buffers claim up to byte {end}")
            try:
                mm = mmap.mmap(fd, end, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:  # e.g. F_SEAL_WRITE: the worker could not load into it
                raise RegionError(f"fd {index}: cannot map the memfd read-write: {exc.strerror}") from None
            self._maps.append(mm)
            mapped.append(np.frombuffer(mm, dtype=np.uint8))
        return mapped

    def _validate_bounds(self) -> None:
        for i, ls in enumerate(self.layers):
            end = ls.offset_bytes + (self.num_blocks - 1) * ls.block_stride_bytes + self.page_bytes
            size = self.buffers[ls.buffer_index].nbytes
            if end > size:
                raise RegionError(f"layer {i}: last page ends at byte {end}, buffer {ls.buffer_index} "
                                  f"has {size} bytes")

    def close(self) -> None:
        self._close_signals()
        self.layer_views = []
        self.buffers = []
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still referenced; unmapped when collected
        self._maps = []
