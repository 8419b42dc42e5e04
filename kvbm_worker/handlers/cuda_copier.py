"""GPU copies of whole blocks between G1 pages (the engine's KV cache, opened through CUDA IPC)
and pinned host slots, one CUDA stream per direction.

Runs in the worker daemon (``kvbm-worker --gpu N``) on its two lane threads: stores use the
D2H stream, loads the H2D stream, so offload and onboard overlap on the two copy engines; a
lane waits for its own CUDA event, never the event loop.

Mechanisms (``--cuda-copy``, :class:`CopyMechanism`):

* ``runs``: one ``cudaMemcpyAsync`` per contiguous run. Pages that are adjacent on both sides
  (every layer of a block in a cross-layer layout, consecutive blocks into consecutive slots)
  are merged first, so a vLLM cross-layer cache moves in >= 2 MiB DMAs.
* ``batch``: the same runs in one ``cudaMemcpyBatchAsync`` call per 4096 (CUDA >= 12.8), through
  cuda-python.
* ``direct``: the batch API called through ``ctypes`` on torch's runtime, with the pieces' events
  made the same way (:mod:`.cudart_direct`); used only after a copy through it moved the right
  bytes at start. A load's call keeps the interpreter lock, unless it has at least ``split_min``
  copies: then it is issued from ``issue_threads`` threads at once, each giving up the lock
  (:mod:`.issuers`: a KV cache allocated per layer gives a copy per block and layer). A store's
  call gives up the lock, so a long store never holds up the load lane.
* ``gather``: pages gathered on the GPU (``index_select``) into a staging buffer, then one DMA
  per contiguous slot run (loads: DMA then ``index_copy_``). Uses SMs briefly; needs every
  layer's offset and stride to be multiples of the page size.
* ``auto`` (the default): ``direct`` where it passed that check, else ``batch`` where the CUDA
  runtime has it; else ``runs`` when the runs
  of a batch average at least 256 KiB (or the layout cannot be gathered), else ``gather``.

Everything CUDA is imported lazily: this module imports on a machine without CUDA.
"""
from __future__ import annotations

import contextlib
import enum
import logging
from typing import Any, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from ..cuda_region import CudaEngineRegion, CudaError, check, cudart
from ..id_arrays import EngineBlocks
from ..runs import page_range, segments
from . import cudart_direct
from .cudart_direct import BATCH_MAX
from .gather_views import GatherViews as GatherViews
from .issuers import SPLIT_MIN_COPIES, Issuers
from .pinned import PinnedHost
from .signal_words import SignalWords

log = logging.getLogger("kvbm.worker")

Addrs = npt.NDArray[np.int64]
STAGING_BYTES = 128 << 20  # per direction, on the GPU
AUTO_DMA_MIN_BYTES = 256 << 10  # auto: runs at least this long on average go straight to DMA


class Direction(str, enum.Enum):
    D2H = "d2h"  # G1 -> host (stores)
    H2D = "h2d"  # host -> G1 (loads)


class CopyMechanism(str, enum.Enum):
    """``--cuda-copy``; see the module docstring."""

    AUTO = "auto"
    RUNS = "runs"
    BATCH = "batch"
    DIRECT = "direct"
    GATHER = "gather"


MECHANISMS = tuple(m.value for m in CopyMechanism)


def _event(timed: bool = False) -> Any:
    """A new CUDA event (torch's constructor is untyped); ``timed``: usable in ``elapsed_time``."""
    import torch
    new: Any = torch.cuda.Event
    return new(enable_timing=timed)


class CudaCopier:
    """Moves whole blocks between G1 pages and host slots (any pinned address), one stream per direction.

    Owns the streams and the GPU staging buffers. ``copy`` returns the CUDA event that marks
    completion (waited for when ``wait``).
    """

    def __init__(self, device: int, pinned: PinnedHost, mechanism: str = CopyMechanism.AUTO,
                 staging_bytes: int = STAGING_BYTES, issue_threads: int = 1,
                 split_min: int = SPLIT_MIN_COPIES) -> None:
        import torch
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown copy mechanism {mechanism!r}; one of {', '.join(MECHANISMS)}")
        self.device, self.pinned, self.mechanism = device, pinned, CopyMechanism(mechanism)
        self.staging_bytes = staging_bytes
        stream: Any = torch.cuda.Stream  # (untyped constructor)
        self.streams = {d: stream(device=device) for d in Direction}
        self._clock = stream(device=device)  # nothing but timing events: :meth:`now`
        self._staging: dict[Direction, Any] = {}
        self._views: dict[str, GatherViews] = {}
        self._batch_ok: bool | None = None
        self.last_mechanism = ""
        self._words: SignalWords | None = None  # the signal-word writes (write_word), made on first use
        rt = cudart()
        self._attr = None
        if hasattr(rt, "cudaMemcpyBatchAsync"):
            attr = rt.cudaMemcpyAttributes()
            attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            attr.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
            self._attr = attr
        else:
            self._batch_ok = False
        self._direct: cudart_direct.Direct | None = None
        if self.mechanism in (CopyMechanism.AUTO, CopyMechanism.DIRECT):
            self._direct = cudart_direct.checked(device)
        # loads' long copy lists (a per-layer KV cache's pages) issued from several threads at once
        self._issuers = Issuers(self._direct, device, issue_threads, split_min) \
            if self._direct is not None and issue_threads > 1 else None

    def warm(self, direction: str, host_src: int | None = None, nbytes: int = 4 << 20) -> None:
        """One copy in ``direction`` on its stream, with the mechanism real copies use, on the
        calling thread (a lane's), so per-thread first-use costs are paid at start. A precaution:
        the first-load delay measured on the H100 (2026-11-22) turned out to be the event loop
        (``np.unique``'s first call, see ``plan_check._has_duplicates``); this warm-up's own effect
        was not measured apart. ``host_src``: pinned bytes to read for H2D (never written)."""
        import torch
        direction = Direction(direction)
        torch.cuda.set_device(self.device)
        check(cudart().cudaSetDevice(self.device), "cudaSetDevice")
        stream = self.streams[direction]
        with self._torch_on(stream):
            dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
            host = None
            if direction is Direction.D2H or host_src is None:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                host_src = host.data_ptr()
            half = nbytes // 2
            h, d = np.array([host_src, host_src + half]), np.array([dev.data_ptr(), dev.data_ptr() + half])
            src, dst = (d, h) if direction is Direction.D2H else (h, d)
            self._issue(src, dst, np.array([half, half]), self._dma_mechanism(), stream)
            self.record(stream).synchronize()
            del host, dev

    # ------------------------------------------------------------------ entry
    def now(self) -> Any:
        """A timing event of the GPU's clock now (for ``copy(..., timed=True)``'s
        ``elapsed_time``: the GPU's own account of when a copy landed): recorded on a stream
        with nothing queued, so it fires at once, not behind the copies queued on a copy stream
        (a staged load's copies into its area, on the load stream, run up to a whole load's time
        after the job's start, and a scatter beside them can land before they do)."""
        return self.record(self._clock, timed=True)

    def record(self, stream: Any, timed: bool = False) -> Any:
        """A CUDA event recorded now on ``stream``: one of the direct calls' where they are in
        use (so that every event of this copier is of one kind: ``elapsed_time`` pairs them),
        else torch's. ``timed``: usable in ``elapsed_time``."""
        if self._direct is not None:
            raw = self._direct.event(timed)
            raw.record(stream.cuda_stream)
            return raw
        event = _event(timed)
        event.record(stream)
        return event

    def write_word(self, direction: str, address: int, value: int, after: Sequence[Any] = ()) -> Any:
        """Write the uint32 ``value`` at ``address`` (host memory registered with CUDA) once every
        copy issued on ``direction``'s stream before has landed, and every event in ``after`` (of
        :meth:`record`: work on other streams, such as a staged load's scatter) fired, holding
        neither that stream nor the caller (:class:`~.signal_words.SignalWords`). Returns the
        CUDA event of the write."""
        if self._words is None:
            self._words = SignalWords(self.device, self.record, self.wait_for)
        return self._words.write(self.streams[Direction(direction)], address, value, after)

    def wait_for(self, stream: Any, event: Any) -> None:
        """``stream`` runs nothing enqueued after this before ``event`` (of :meth:`record`) fired."""
        if self._direct is not None:
            self._direct.wait(stream.cuda_stream, event)
        else:
            stream.wait_event(event)

    def copy(self, direction: str, region: CudaEngineRegion, blocks: Sequence[int] | Addrs, host_addrs: Addrs,
             wait: bool = True, mechanism: str | None = None, pages: tuple[int, int] | None = None,
             timed: bool = False) -> Any:
        """``direction`` D2H: every layer's page of ``blocks[i]`` -> ``host_addrs[i]`` (slot layout,
        layer by layer); H2D: the reverse. ``pages``: only the pages ``[lo, hi)`` of each block
        (direct DMA: a gather falls back to it). Returns the CUDA event of completion (``timed``:
        a timing one, see :meth:`now`)."""
        direction = Direction(direction)
        ids = EngineBlocks(np.asarray(blocks, dtype=np.int64))
        host_addrs = np.asarray(host_addrs, dtype=np.int64)
        stream = self.streams[direction]
        mech = self._choose(region, ids, host_addrs, CopyMechanism(mechanism or self.mechanism))
        if pages is not None and mech is CopyMechanism.GATHER:
            mech = CopyMechanism.BATCH if self._batch_ok is not False else CopyMechanism.RUNS
        self.last_mechanism = mech.value
        # the direct calls name their stream: no torch device or stream context to enter per piece
        with contextlib.nullcontext() if mech is CopyMechanism.DIRECT else self._torch_on(stream):
            if mech is CopyMechanism.GATHER:
                self._gather(direction, region, ids, host_addrs, stream)
            else:
                src, dst = self._pages(direction, region, ids, host_addrs, pages)
                self._dma(src, dst, region.page_bytes, direction is Direction.H2D, mech, stream)
        event = self.record(stream, timed)
        if wait:
            event.synchronize()
        return event

    @contextlib.contextmanager
    def _torch_on(self, stream: Any) -> Iterator[None]:
        """torch's device and current stream set to this copier's and ``stream``."""
        import torch
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield

    def _choose(self, region: CudaEngineRegion, blocks: EngineBlocks, host_addrs: Addrs,
                mech: CopyMechanism) -> CopyMechanism:
        if mech is CopyMechanism.GATHER and not self.gather_views(region).ok:
            mech = CopyMechanism.AUTO
        if mech is CopyMechanism.DIRECT and self._direct is None:
            mech = CopyMechanism.BATCH  # (its check failed at start: logged there)
        if mech is not CopyMechanism.AUTO:
            return CopyMechanism.RUNS if mech is CopyMechanism.BATCH and self._batch_ok is False else mech
        if self._direct is not None:
            return CopyMechanism.DIRECT
        # NOTE: measured on H100 (README): the batch API matches the gather kernel's bandwidth on
        # 32 KiB pages and slows a concurrent matmul by ~1 % where the gather kernel costs 13-21 %,
        # so gather is only the fallback for small runs when the batch API is missing.
        if self._batch_ok is not False:
            return CopyMechanism.BATCH
        src, dst = self._pages(Direction.D2H, region, EngineBlocks(blocks[:64]), host_addrs[:64])
        _, _, lengths = segments(src, dst, region.page_bytes)
        if lengths.mean() >= AUTO_DMA_MIN_BYTES or not self.gather_views(region).ok:
            return CopyMechanism.RUNS
        return CopyMechanism.GATHER

    # ------------------------------------------------------------------ direct DMA
    @staticmethod
    def _pages(direction: Direction, region: CudaEngineRegion, blocks: EngineBlocks, host_addrs: Addrs,
               pages: tuple[int, int] | None = None) -> tuple[Addrs, Addrs]:
        lo, hi = page_range(pages, region.num_layers)
        g1 = np.ascontiguousarray(region.page_addresses(blocks)[:, lo:hi]).ravel()
        host = (host_addrs[:, None] + np.arange(lo, hi, dtype=np.int64)[None, :] * region.page_bytes).ravel()
        return (g1, host) if direction is Direction.D2H else (host, g1)

    def _dma(self, src: Addrs, dst: Addrs, unit: int, host_is_src: bool, mech: CopyMechanism, stream: Any) -> None:
        """Merge adjacent copies, never across (nor, after ``split``, through) a pinned-range edge; issue."""
        host = src if host_is_src else dst
        s, d, n = segments(src, dst, unit, self.pinned.chunk_ids(host))
        self._issue(*self.pinned.split(s, d, n, s if host_is_src else d), mech, stream)

    def _issue(self, src: Addrs, dst: Addrs, lengths: Addrs, mech: CopyMechanism, stream: Any) -> None:
        handle = stream.cuda_stream
        if mech is CopyMechanism.DIRECT and self._direct is not None:
            if self._issuers is not None and stream is self.streams[Direction.H2D] and self._issuers.splits(len(src)):
                self._issuers.issue(dst, src, lengths, handle)
                return
            # a store's call gives up the interpreter lock: a per-layer cache's cold 20K store is ~45K
            # copies, ~1 us of driver CPU each, which would otherwise hold up the load lane and the loop
            self._direct.batch(dst, src, lengths, handle, release=stream is self.streams[Direction.D2H])
            return
        rt = cudart()
        if mech is CopyMechanism.BATCH and self._batch_ok is not False:
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

    def issue_h2d(self, src: Addrs, dst: Addrs, unit: int) -> None:
        """``unit``-byte copies pinned host ``src[i]`` -> device ``dst[i]`` on the load stream, by
        the mechanism whole-block DMAs use (not waited for: :meth:`record` an event after them)."""
        self._dma(src, dst, unit, True, self._dma_mechanism(), self.streams[Direction.H2D])

    def _dma_mechanism(self) -> CopyMechanism:
        """How whole runs are issued here: the direct calls, else the batch API where it works, else one by one."""
        return CopyMechanism.DIRECT if self._direct is not None else \
            CopyMechanism.BATCH if self._batch_ok is not False else CopyMechanism.RUNS

    # ------------------------------------------------------------------ gather / scatter
    def gather_views(self, region: CudaEngineRegion) -> GatherViews:
        """``region``'s page views (made once per region)."""
        views = self._views.get(region.region_id)
        if views is None:
            views = GatherViews(region)
            self._views = {region.region_id: views}  # one region at a time
        return views

    def _stage(self, direction: Direction, nbytes: int) -> Any:
        import torch
        buf = self._staging.get(direction)
        if buf is None or buf.numel() < nbytes:
            buf = self._staging[direction] = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
        return buf

    def _gather(self, direction: Direction, region: CudaEngineRegion, blocks: EngineBlocks, host_addrs: Addrs,
                stream: Any) -> None:
        import torch
        views = self.gather_views(region)
        region.check_blocks(blocks)  # the page indices below address the region's buffers
        nl, p = region.num_layers, region.page_bytes
        block_bytes = nl * p
        per = max(1, min(len(blocks), self.staging_bytes // block_bytes))
        stage = self._stage(direction, per * block_bytes)
        dev = stage.device
        # every index the batch needs, uploaded once (a pageable upload syncs the stream: do it first)
        idx = [torch.from_numpy((views.page_offset[ids][None, :] + blocks[:, None] * views.page_stride[ids][None, :])
                                .ravel()).to(dev) for ids, _ in views.groups]
        rows = [] if views.single else [
            torch.from_numpy((np.arange(len(blocks))[:, None] * nl + ids[None, :]).ravel()).to(dev)
            for ids, _ in views.groups]
        for start in range(0, len(blocks), per):
            m = min(per, len(blocks) - start)
            sp = stage[:m * block_bytes].view(m * nl, p)
            sp = sp.view(torch.int64) if views.wide else sp
            stage_addrs = stage.data_ptr() + np.arange(m, dtype=np.int64) * block_bytes
            hosts = host_addrs[start:start + m]
            if direction is Direction.H2D:
                self._dma(hosts, stage_addrs, block_bytes, True, CopyMechanism.BATCH, stream)
            for g, (ids, pages) in enumerate(views.groups):
                lo, hi = start * len(ids), (start + m) * len(ids)
                if direction is Direction.D2H:
                    if views.single:
                        torch.index_select(pages, 0, idx[g][lo:hi], out=sp)
                    else:
                        sp.index_copy_(0, rows[g][lo:hi] - start * nl, pages.index_select(0, idx[g][lo:hi]))
                elif views.single:
                    pages.index_copy_(0, idx[g][lo:hi], sp)
                else:
                    pages.index_copy_(0, idx[g][lo:hi], sp.index_select(0, rows[g][lo:hi] - start * nl))
            if direction is Direction.D2H:
                self._dma(stage_addrs, hosts, block_bytes, False, CopyMechanism.BATCH, stream)

    def close(self) -> None:
        if self._issuers is not None:
            self._issuers.close()
        for stream in self.streams.values():
            stream.synchronize()
        if self._words is not None:
            self._words.synchronize()
        self._staging.clear()
        self._views.clear()
