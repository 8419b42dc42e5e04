"""The GPU data path of a worker (``kvbm-worker --gpu N``): the CUDA context, CUDA IPC regions,
and :class:`CudaMover`, the copy executor's CUDA medium.

Runs in the worker daemon. G1 (the engine's KV cache, opened through CUDA IPC) <-> G2 pinned
host slots, and G1 <-> G3 through pinned bounce buffers; the copies themselves are
:class:`~.cuda_copier.CudaCopier`'s (mechanisms: ``--cuda-copy``, see that module). Shared
memory regions on a GPU worker, demotions and promotions take the CPU paths of
:class:`~kvbm_worker.mover.BlockMover`.

Everything CUDA is imported lazily: this module imports on a machine without CUDA.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvbm_client.contract import pb

from ..cuda_region import CudaEngineRegion, CudaError, check, cudart
from ..grouping import GroupPacing
from ..handlers.disk_guard import TimedDiskIO
from ..id_arrays import EngineBlocks
from ..lanes import Lane
from ..loads_first import STORE_YIELD_MS
from ..mover import BlockMover
from ..pending import Pending
from ..pools import DiskPool, HostPool
from ..regions import EngineRegion, Peer, RegionError
from ..stages import StageLayout
from .cuda_copier import MECHANISMS as MECHANISMS
from .cuda_copier import CopyMechanism, CudaCopier as CudaCopier, Direction
from .cuda_stage import CudaStage
from .issuers import SPLIT_MIN_COPIES
from .pinned import PIN_CHUNK, PinnedHost

log = logging.getLogger("kvbm.worker")

Ids = npt.NDArray[np.int64]
Rows = npt.NDArray[np.uint8]


def init_device(device: int) -> str:
    """Create the CUDA context of ``device`` in this process (off the event loop); returns its name."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("--gpu given but torch sees no CUDA device")
    torch.cuda.set_device(device)
    torch.empty(1, device=f"cuda:{device}")
    check(cudart().cudaSetDevice(device), "cudaSetDevice")
    return str(torch.cuda.get_device_name(device))


def open_region(request: "pb.RegisterRegionRequest", fds: Sequence[int], owner: Peer, device: int) -> EngineRegion:
    """Region factory of a GPU worker: CUDA IPC buffers open on ``device``; memfd buffers stay on the CPU path."""
    if any(b.WhichOneof("handle") == "cuda_ipc_handle" for b in request.buffers):
        if fds:
            raise RegionError(f"a CUDA region carries no fds; {len(fds)} came with the request")
        try:
            return CudaEngineRegion(request, owner, device)
        except CudaError as exc:
            raise RegionError(str(exc)) from None
    return EngineRegion(request, fds, owner)


class _Event:
    """A CUDA event as a :class:`~kvbm_worker.pending.Pending` copy."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()

    def landed(self) -> bool:
        return bool(self.event.query())


class CudaMover(BlockMover):
    """The GPU worker's copy executor: pins G2 and the bounce buffers, copies CUDA regions'
    pages with a :class:`CudaCopier`. Owns the pinned registrations, the copier and the
    staging area (:class:`~.cuda_stage.CudaStage`, with ``stage_bytes``).
    """

    def __init__(self, host: HostPool | None, disk: DiskPool | None, disk_io: TimedDiskIO | None, *,
                 host_checksums: bool = False, pacing: GroupPacing = GroupPacing(),
                 store_yield_ms: float = STORE_YIELD_MS, device: int,
                 mechanism: CopyMechanism = CopyMechanism.AUTO, progress: Callable[[float], None] | None = None,
                 deadline: float | None = None, issue_threads: int = 1,
                 split_min: int = SPLIT_MIN_COPIES, stage_bytes: int = 0) -> None:
        super().__init__(host, disk, disk_io, host_checksums=host_checksums, pacing=pacing,
                         store_yield_ms=store_yield_ms, stage_bytes=stage_bytes)
        self.staging: CudaStage | None = None
        self.device = device
        self.pinned = PinnedHost(device)
        try:
            if host is not None:
                chunk = max(1, PIN_CHUNK // host.geometry.slot_bytes) * host.geometry.slot_bytes
                self.pinned.pin(host.address, host.buffer.nbytes, chunk, progress, deadline)
            for buf in self.bounce.values():
                self.pinned.pin(buf.slots.ctypes.data, buf.slots.nbytes)
            self.copier = CudaCopier(device, self.pinned, mechanism, issue_threads=issue_threads, split_min=split_min)
            if stage_bytes:
                self.staging = CudaStage(self.copier, stage_bytes)
        except BaseException:
            if getattr(self, "copier", None) is not None:
                self.copier.close()
            self.pinned.close()
            super().close()
            raise

    def warm_lane(self, lane: Lane) -> None:
        """Loads read G2 (its first pinned chunk is read, never written), and warm the staging
        area's scatter on its own bytes; stores write a scratch buffer."""
        direction = Direction.D2H if lane is Lane.STORE else Direction.H2D
        host_src = self.host.address if self.host is not None and self.host.buffer.nbytes >= 4 << 20 else None
        t0 = time.perf_counter()
        self.copier.warm(direction, host_src)
        if lane is Lane.LOAD and self.staging is not None:
            self.staging.warm()
        log.debug("%s lane warmed up in %.1f ms", lane.value, (time.perf_counter() - t0) * 1e3)

    def _enter_lane(self, region: EngineRegion | None) -> None:
        if isinstance(region, CudaEngineRegion):
            import torch
            torch.cuda.set_device(self.device)
            cudart().cudaSetDevice(self.device)

    def _to_slots(self, region: EngineRegion, blocks: EngineBlocks, rows: Rows, picks: Ids) -> Pending:
        if not isinstance(region, CudaEngineRegion):
            return super()._to_slots(region, blocks, rows, picks)
        addrs = rows.ctypes.data + picks * rows.shape[1]
        return _Event(self.copier.copy(Direction.D2H, region, blocks, addrs, wait=False))

    def _from_slots(self, region: EngineRegion, blocks: EngineBlocks, rows: Rows, picks: Ids,
                    pages: tuple[int, int] | None = None, timed: bool = False) -> Pending:
        if not isinstance(region, CudaEngineRegion):
            return super()._from_slots(region, blocks, rows, picks, pages)
        addrs = rows.ctypes.data + picks * rows.shape[1]
        return _Event(self.copier.copy(Direction.H2D, region, blocks, addrs, wait=False, pages=pages, timed=timed))

    def stage_refusal(self, region: EngineRegion) -> str | None:
        if not isinstance(region, CudaEngineRegion) or self.staging is None:
            return super().stage_refusal(region)
        return self.staging.can_scatter(region)

    def _to_stage(self, region: EngineRegion, rows: Rows, picks: Ids, layout: StageLayout) -> None:
        if not isinstance(region, CudaEngineRegion):
            return super()._to_stage(region, rows, picks, layout)
        assert self.staging is not None, "a stage without a staging area"
        self.staging.stage(rows.ctypes.data + picks * rows.shape[1], layout)

    def _from_stage(self, region: EngineRegion, blocks: EngineBlocks, layout: StageLayout, g: int,
                    timed: bool = False) -> Pending:
        if not isinstance(region, CudaEngineRegion):
            return super()._from_stage(region, blocks, layout, g, timed)
        assert self.staging is not None, "a staged group without a staging area"
        return _Event(self.staging.scatter(region, blocks, layout, g))

    def _signal(self, region: EngineRegion, slot: int, value: int) -> Pending:
        if not isinstance(region, CudaEngineRegion):
            return super()._signal(region, slot, value)
        assert region.signals is not None and region.signals.device_ptr is not None, "a signal page without CUDA"
        # (a staged group's scatter runs beside the load stream: the word waits for the last one too)
        last = self.staging.last_scatter if self.staging is not None else None
        return _Event(self.copier.write_word(Direction.H2D, region.signals.device_ptr + 4 * slot, value,
                                             after=() if last is None else (last,)))

    def _gpu_mark(self) -> object | None:
        mark: object = self.copier.now()
        return mark

    def _gpu_ms(self, mark: object, copy: Pending) -> float | None:
        if not isinstance(copy, _Event):
            return None  # a piece the CPU path copied
        return float(mark.elapsed_time(copy.event))  # type: ignore[attr-defined]  # (a torch.cuda.Event)

    def close(self) -> None:
        staging, copier = getattr(self, "staging", None), getattr(self, "copier", None)
        if staging is not None:
            staging.close()
        if copier is not None:
            copier.close()
        self.pinned.close()
        super().close()
