"""GPU copies: G1 (the engine's KV cache, opened through CUDA IPC) <-> G2 pinned host slots,
and G1 <-> G3 through pinned bounce buffers.

Runs in the worker daemon (``kvbm-worker --gpu N``) on its two lane threads: stores use the
``d2h`` stream, loads the ``h2d`` stream, so offload and onboard overlap on the two copy
engines; a lane waits for its own CUDA event, never the event loop.

Mechanisms (``--cuda-copy``); ``auto`` takes ``batch`` (where the CUDA runtime has it), else
``runs`` for long runs and ``gather`` for small pages, as measured on an H100 (README, "GPU data
path"):

* ``runs``: one ``cudaMemcpyAsync`` per contiguous run. Pages that are adjacent on both sides
  (every layer of a block in a cross-layer layout, consecutive blocks into consecutive slots)
  are merged first, so a vLLM cross-layer cache moves in >= 2 MiB DMAs.
* ``batch``: the same runs in one ``cudaMemcpyBatchAsync`` call per 4096 (CUDA >= 12.8).
* ``gather``: pages gathered on the GPU (``index_select``) into a staging buffer, then one DMA
  per contiguous slot run (loads: DMA then ``index_copy_``). Uses SMs briefly; needs every
  layer's offset and stride to be multiples of the page size.

Everything CUDA is imported lazily: this module imports on a machine without CUDA.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import numpy as np

from kvbm_client.ids import PlanKind, Tier

from ..cuda_region import CudaEngineRegion, CudaError, check, cudart
from ..regions import EngineRegion, RegionError
from .pinned import PIN_CHUNK, PinnedHost, segments
from ..transfers import Batch, TransferEngine

log = logging.getLogger("kvbm.worker")

MECHANISMS = ("auto", "runs", "batch", "gather")
STAGING_BYTES = 128 << 20  # per direction, on the GPU
BATCH_MAX = 4096  # copies per cudaMemcpyBatchAsync call
AUTO_DMA_MIN_BYTES = 256 << 10  # auto: runs at least this long on average go straight to DMA


def init_device(device: int) -> str:
    """Create the CUDA context of ``device`` in this process (off the event loop); returns its name."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("--gpu given but torch sees no CUDA device")
    torch.cuda.set_device(device)
    torch.empty(1, device=f"cuda:{device}")
    check(cudart().cudaSetDevice(device), "cudaSetDevice")
    return torch.cuda.get_device_name(device)


def open_region(request, device: int) -> EngineRegion:
    """Region factory of a GPU worker: CUDA IPC buffers open on ``device``; shm buffers stay on the CPU path."""
    if any(b.WhichOneof("handle") == "cuda_ipc_handle" for b in request.buffers):
        try:
            return CudaEngineRegion(request, device)
        except CudaError as exc:
            raise RegionError(str(exc)) from None
    return EngineRegion(request)


class _GatherPlan:
    """Page-granular views of a region's buffers, for the gather mechanism (or None if unaligned)."""

    def __init__(self, region: CudaEngineRegion) -> None:
        import torch
        p = region.page_bytes
        self.wide = p % 8 == 0 and all(ptr % 8 == 0 for ptr in region.buffer_ptrs)
        self.groups: list[tuple[np.ndarray, object]] = []  # (layer indices, pages view)
        offsets = np.array([ls.offset_bytes for ls in region.layers], np.int64)
        by_buffer: dict[int, list[int]] = {}
        for i, ls in enumerate(region.layers):
            by_buffer.setdefault(ls.buffer_index, []).append(i)
        self.ok = bool(np.all(offsets % p == 0) and np.all(region.layer_stride % p == 0))
        if not self.ok:
            return
        for b, layer_ids in by_buffer.items():
            buf = region.buffers[b]
            pages = buf[:(buf.numel() // p) * p].view(-1, p)
            self.groups.append((np.array(layer_ids, np.int64), pages.view(torch.int64) if self.wide else pages))
        self.page_offset = offsets // p
        self.page_stride = region.layer_stride // p
        self.single = len(self.groups) == 1 and np.array_equal(self.groups[0][0], np.arange(region.num_layers))


class CudaCopier:
    """Moves whole blocks between G1 pages and host slots (any pinned address), one stream per direction.

    Owns the streams and the GPU staging buffers. ``copy`` returns the CUDA event that marks
    completion (waited for when ``wait``).
    """

    def __init__(self, device: int, pinned: PinnedHost, mechanism: str = "auto",
                 staging_bytes: int = STAGING_BYTES) -> None:
        import torch
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown copy mechanism {mechanism!r}; one of {', '.join(MECHANISMS)}")
        self.device, self.pinned, self.mechanism = device, pinned, mechanism
        self.staging_bytes = staging_bytes
        self.streams = {d: torch.cuda.Stream(device=device) for d in ("d2h", "h2d")}
        self._staging: dict[str, object] = {}
        self._gather_plans: dict[str, _GatherPlan] = {}
        self._batch_ok: bool | None = None
        self.last_mechanism = ""
        rt = cudart()
        self._attr = None
        if hasattr(rt, "cudaMemcpyBatchAsync"):
            attr = rt.cudaMemcpyAttributes()
            attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            attr.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
            self._attr = attr
        else:
            self._batch_ok = False

    def warm(self, direction: str, host_src: int | None = None, nbytes: int = 4 << 20) -> None:
        """One copy in ``direction`` on its stream, with the mechanism real copies use, on the
        calling thread (a lane's), so per-thread first-use costs are paid at start. A precaution:
        the first-load delay measured on the H100 (2026-11-22) turned out to be the event loop
        (``np.unique``'s first call, see ``service._has_duplicates``); this warm-up's own effect
        was not measured apart. ``host_src``: pinned bytes to read for "h2d" (never written)."""
        import torch
        torch.cuda.set_device(self.device)
        check(cudart().cudaSetDevice(self.device), "cudaSetDevice")
        stream = self.streams[direction]
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
            host = None
            if direction == "d2h" or host_src is None:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                host_src = host.data_ptr()
            half = nbytes // 2
            h, d = np.array([host_src, host_src + half]), np.array([dev.data_ptr(), dev.data_ptr() + half])
            src, dst = (d, h) if direction == "d2h" else (h, d)
            self._issue(src, dst, np.array([half, half]), "batch" if self._attr is not None else "runs", stream)
            event = torch.cuda.Event()
            event.record(stream)
            event.synchronize()
            del host, dev

    # ------------------------------------------------------------------ entry
    def copy(self, direction: str, region: CudaEngineRegion, blocks: Sequence[int], host_addrs: np.ndarray,
             wait: bool = True, mechanism: str | None = None):
        """``direction`` "d2h": every layer's page of ``blocks[i]`` -> ``host_addrs[i]`` (slot layout,
        layer by layer); "h2d": the reverse."""
        import torch
        blocks = np.asarray(blocks, dtype=np.int64)
        host_addrs = np.asarray(host_addrs, dtype=np.int64)
        stream = self.streams[direction]
        mech = self._choose(region, blocks, host_addrs, mechanism or self.mechanism)
        self.last_mechanism = mech
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if mech == "gather":
                self._gather(direction, region, blocks, host_addrs, stream)
            else:
                src, dst = self._pages(direction, region, blocks, host_addrs)
                self._dma(src, dst, region.page_bytes, direction == "h2d", mech, stream)
            event = torch.cuda.Event()
            event.record(stream)
        if wait:
            event.synchronize()
        return event

    def _choose(self, region, blocks, host_addrs, mech: str) -> str:
        if mech == "gather" and not self._plan(region).ok:
            mech = "auto"
        if mech != "auto":
            return "runs" if mech == "batch" and self._batch_ok is False else mech
        # NOTE: measured on H100 (README): the batch API matches the gather kernel's bandwidth on
        # 32 KiB pages and slows a concurrent matmul by ~1 % where the gather kernel costs 13-21 %,
        # so gather is only the fallback for small runs when the batch API is missing.
        if self._batch_ok is not False:
            return "batch"
        src, dst = self._pages("d2h", region, blocks[:64], host_addrs[:64])
        _, _, lengths = segments(src, dst, region.page_bytes)
        if lengths.mean() >= AUTO_DMA_MIN_BYTES or not self._plan(region).ok:
            return "runs"
        return "gather"

    # ------------------------------------------------------------------ direct DMA
    @staticmethod
    def _pages(direction, region, blocks, host_addrs):
        g1 = region.page_addresses(blocks).ravel()
        host = (host_addrs[:, None] + np.arange(region.num_layers, dtype=np.int64)[None, :] * region.page_bytes).ravel()
        return (g1, host) if direction == "d2h" else (host, g1)

    def _dma(self, src, dst, unit: int, host_is_src: bool, mech: str, stream) -> None:
        """Merge adjacent copies, never across (nor, after ``split``, through) a pinned-range edge; issue."""
        host = src if host_is_src else dst
        s, d, n = segments(src, dst, unit, self.pinned.chunk_ids(host))
        self._issue(*self.pinned.split(s, d, n, s if host_is_src else d), mech, stream)

    def _issue(self, src, dst, lengths, mech: str, stream) -> None:
        rt = cudart()
        handle = stream.cuda_stream
        if mech == "batch" and self._batch_ok is not False:
            try:
                for i in range(0, len(src), BATCH_MAX):
                    d, s, n = dst[i:i + BATCH_MAX].tolist(), src[i:i + BATCH_MAX].tolist(), \
                        lengths[i:i + BATCH_MAX].tolist()
                    check(rt.cudaMemcpyBatchAsync(d, s, n, len(d), [self._attr], [0], 1, handle),
                          "cudaMemcpyBatchAsync")
                self._batch_ok = True
                return
            except (CudaError, TypeError) as exc:
                if self._batch_ok:
                    raise
                self._batch_ok = False  # the copies are idempotent: issue them again one by one
                log.warning("cudaMemcpyBatchAsync unusable (%s); using one cudaMemcpyAsync per run", exc)
        kind, ok, memcpy = rt.cudaMemcpyKind.cudaMemcpyDefault, rt.cudaError_t.cudaSuccess, rt.cudaMemcpyAsync
        for d, s, n in zip(dst.tolist(), src.tolist(), lengths.tolist()):
            err = memcpy(d, s, n, kind, handle)[0]
            if err != ok:
                raise CudaError(f"cudaMemcpyAsync({n} bytes): {getattr(err, 'name', err)}")

    # ------------------------------------------------------------------ gather / scatter
    def _plan(self, region: CudaEngineRegion) -> _GatherPlan:
        plan = self._gather_plans.get(region.region_id)
        if plan is None:
            plan = _GatherPlan(region)
            self._gather_plans = {region.region_id: plan}  # one region at a time
        return plan

    def _stage(self, direction: str, nbytes: int):
        import torch
        buf = self._staging.get(direction)
        if buf is None or buf.numel() < nbytes:
            buf = self._staging[direction] = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
        return buf

    def _gather(self, direction, region, blocks, host_addrs, stream) -> None:
        import torch
        plan = self._plan(region)
        nl, p = region.num_layers, region.page_bytes
        block_bytes = nl * p
        per = max(1, min(len(blocks), self.staging_bytes // block_bytes))
        stage = self._stage(direction, per * block_bytes)
        dev = stage.device
        # every index the batch needs, uploaded once (a pageable upload syncs the stream: do it first)
        idx = [torch.from_numpy((plan.page_offset[ids][None, :] + blocks[:, None] * plan.page_stride[ids][None, :])
                                .ravel()).to(dev) for ids, _ in plan.groups]
        rows = None if plan.single else [
            torch.from_numpy((np.arange(len(blocks))[:, None] * nl + ids[None, :]).ravel()).to(dev)
            for ids, _ in plan.groups]
        for start in range(0, len(blocks), per):
            m = min(per, len(blocks) - start)
            sp = stage[:m * block_bytes].view(m * nl, p)
            sp = sp.view(torch.int64) if plan.wide else sp
            stage_addrs = stage.data_ptr() + np.arange(m, dtype=np.int64) * block_bytes
            hosts = host_addrs[start:start + m]
            if direction == "h2d":
                self._dma(hosts, stage_addrs, block_bytes, True, "batch", stream)
            for g, (ids, pages) in enumerate(plan.groups):
                lo, hi = start * len(ids), (start + m) * len(ids)
                if direction == "d2h":
                    if plan.single:
                        torch.index_select(pages, 0, idx[g][lo:hi], out=sp)
                    else:
                        sp.index_copy_(0, rows[g][lo:hi] - start * nl, pages.index_select(0, idx[g][lo:hi]))
                elif plan.single:
                    pages.index_copy_(0, idx[g][lo:hi], sp)
                else:
                    pages.index_copy_(0, idx[g][lo:hi], sp.index_select(0, rows[g][lo:hi] - start * nl))
            if direction == "d2h":
                self._dma(stage_addrs, hosts, block_bytes, False, "batch", stream)

    def close(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()
        self._staging.clear()
        self._gather_plans.clear()


class CudaTransferEngine(TransferEngine):
    """The GPU worker's :class:`TransferEngine`: pins G2 and the bounce buffers, copies with a
    :class:`CudaCopier`. CPU regions (shm) and demotions (G2 -> G3) use the inherited paths.
    """

    def __init__(self, host, disk, disk_io, device: int, mechanism: str = "auto",
                 progress: Callable[[float], None] | None = None, deadline: float | None = None) -> None:
        super().__init__(host, disk, disk_io)
        self.device = device
        self.pinned = PinnedHost(device)
        try:
            if host is not None:
                chunk = max(1, PIN_CHUNK // host.geometry.slot_bytes) * host.geometry.slot_bytes
                self.pinned.pin(host.address, host.buffer.nbytes, chunk, progress, deadline)
            for buf in self.bounce.values():
                self.pinned.pin(buf.slots.ctypes.data, buf.slots.nbytes)
            self.copier = CudaCopier(device, self.pinned, mechanism)
        except BaseException:
            self.pinned.close()
            super().close()
            raise

    def warm_lane(self, lane: str) -> None:
        """Loads read G2 (its first pinned chunk is read, never written); stores write a scratch buffer."""
        direction = "d2h" if lane == "store" else "h2d"
        host_src = self.host.address if self.host is not None and self.host.buffer.nbytes >= 4 << 20 else None
        t0 = time.perf_counter()
        self.copier.warm(direction, host_src)
        log.debug("%s lane warmed up in %.1f ms", lane, (time.perf_counter() - t0) * 1e3)

    def run(self, batch: Batch, region: EngineRegion | None) -> int:
        if not isinstance(region, CudaEngineRegion):
            return super().run(batch, region)
        import torch
        torch.cuda.set_device(self.device)
        cudart().cudaSetDevice(self.device)
        moved = self._demote(batch.demote_host, batch.demote_disk)
        store = batch.kind is PlanKind.STORE
        for tier in (Tier.HOST, Tier.DISK):
            picks = np.flatnonzero(np.asarray(batch.tiers, np.int64) == tier)
            if not picks.size:
                continue
            slots = np.asarray(batch.slots, np.int64)[picks]
            blocks = np.asarray(batch.engine_blocks, np.int64)[picks]
            if tier is Tier.HOST:
                addrs = self.host.address + slots * self.host.geometry.slot_bytes
                self.copier.copy("d2h" if store else "h2d", region, blocks, addrs)
            elif store:
                self._disk_store(region, blocks, slots)
            else:
                self._disk_load(region, blocks, slots)
            moved += len(picks) * region.block_bytes
        return moved

    # ------------------------------------------------------------------ G1 <-> G3
    def _bounce_rows(self, lane: str, half: int, m: int) -> np.ndarray:
        bounce = self.bounce[lane]
        per = max(1, bounce.num_slots // 2)
        first = (half % 2) * per if bounce.num_slots > 1 else 0
        return bounce.address(first) + np.arange(m, dtype=np.int64) * bounce.slots.shape[1]

    def _chunks(self, lane: str, n: int) -> list[tuple[int, int]]:
        per = max(1, self.bounce[lane].num_slots // 2)
        return [(s, min(n, s + per)) for s in range(0, n, per)]

    def _disk_io(self, op: str, addrs: np.ndarray, slots: np.ndarray) -> None:
        slot_bytes = self.disk.geometry.slot_bytes
        offsets = slots * slot_bytes
        for a, o, n in zip(*(x.tolist() for x in segments(addrs, offsets, slot_bytes))):
            getattr(self.disk_io, op)([a], [o], n)

    def _disk_store(self, region, blocks: np.ndarray, slots: np.ndarray) -> None:
        """D2H of chunk k+1 into one half of the bounce buffer overlaps the disk write of chunk k."""
        pending = None
        for k, (lo, hi) in enumerate(self._chunks("store", len(blocks))):
            addrs = self._bounce_rows("store", k, hi - lo)
            if pending is not None and self.bounce["store"].num_slots < 2:  # one row: no overlap
                pending[0].synchronize()
                self._disk_io("write", pending[1], pending[2])
                pending = None
            event = self.copier.copy("d2h", region, blocks[lo:hi], addrs, wait=False)
            if pending is not None:
                pending[0].synchronize()
                self._disk_io("write", pending[1], pending[2])
            pending = (event, addrs, slots[lo:hi])
        if pending is not None:
            pending[0].synchronize()
            self._disk_io("write", pending[1], pending[2])

    def _disk_load(self, region, blocks: np.ndarray, slots: np.ndarray) -> None:
        """The disk read of chunk k+1 overlaps the H2D copy of chunk k."""
        events = [None, None]
        for k, (lo, hi) in enumerate(self._chunks("load", len(blocks))):
            for event in (events if self.bounce["load"].num_slots < 2 else events[k % 2:k % 2 + 1]):
                if event is not None:
                    event.synchronize()
            addrs = self._bounce_rows("load", k, hi - lo)
            self._disk_io("read", addrs, slots[lo:hi])
            events[k % 2] = self.copier.copy("h2d", region, blocks[lo:hi], addrs, wait=False)
        for event in events:
            if event is not None:
                event.synchronize()

    def close(self) -> None:
        copier = getattr(self, "copier", None)
        if copier is not None:
            copier.close()
        self.pinned.close()
        super().close()
