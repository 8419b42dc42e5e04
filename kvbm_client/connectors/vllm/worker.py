"""Worker role of the vLLM connector: vLLM's worker hooks over the shared core.

Runs in a vLLM worker process. Everything engine-independent (the region kept registered
with the worker daemon, loads and stores in flight, fences, delayed frees, load errors) is
:class:`~kvbm_client.connectors.core.WorkerCore`; this adapter describes vLLM's KV tensors as
a region and reads vLLM's step metadata.

A step's own stores start in ``wait_for_save`` (the step's KV is written). Those of a step
that completed many blocks (a prefill chunk; ``async_store_plans``) are planned by the scheduler
role while that step runs and ship with the next step: they start in ``bind_connector_metadata``,
before that step's forward is enqueued, ordered after the forward that wrote their blocks
(``StepPlan.earlier_stores``). Stores are awaited only when a
preempted request's blocks may be rewritten (``handle_preemptions`` /
``bind_connector_metadata`` with ``fence``); finished requests whose stores were in flight
are reported in ``finished_sending`` so vLLM frees their blocks only then. Loads start in
``start_load_kv``: a synchronous one (``LoadSpec.sync``) is waited for there, before the
step's forward is enqueued; an asynchronous one is reported in ``finished_recving`` by the
first ``get_finished`` that finds it done. Failed loads come back through
``get_block_ids_with_load_errors`` and vLLM recomputes them.

Layer-pipelined loads (``load_mode`` layerwise): ``start_load_kv`` only sends them;
``wait_for_layer_load`` waits until the layer's pages landed (:func:`layer_page_ends` maps
vLLM's layer names to the region's pages), and ``wait_for_save`` (or ``get_finished``, if
vLLM skipped it) settles them before any store of the step is sent. A step whose forward ran
no layer hook (FULL CUDA graphs) counts its layer-pipelined loads as failed.
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ...ids import EngineBlockId, WorkerId
from ...regions import LayerSpec, RegionSpec, RegionSpecLike
from ...signal_page import EngineSignals
from ..core.settings import ConnectorSettings, GpuWaits, LoadMode
from ..core.specs import StepPlan
from ..core.tracing import trace, tracing
from ..core.worker import WorkerCore

if TYPE_CHECKING:  # (imports vLLM; this module imports without it, for its tests)
    from .metadata import KvbmConnectorMetadata, KvbmWorkerMetadata

log = logging.getLogger("kvbm.connector")


def region_from_kv_caches(kv_caches: dict[str, Any], memfd: int | None, base_tensor: Any) -> RegionSpec | None:
    """Describe vLLM's per-layer KV views as a region over one buffer in the sealed ``memfd``,
    or None when the buffer is not in one (then the daemon cannot be handed it)."""
    if memfd is None or base_tensor is None:
        return None
    base = base_tensor.untyped_storage().data_ptr()
    size = base_tensor.untyped_storage().nbytes()
    layers: list[LayerSpec] = []
    page: int | None = None
    num_blocks: int | None = None
    dtype = ""
    for name, t in kv_caches.items():
        if t.untyped_storage().data_ptr() != base:
            log.warning("kvbm: layer %s is not in the shared KV buffer; kvbm disabled", name)
            return None
        if not t[0].is_contiguous():
            log.warning("kvbm: layer %s pages are not contiguous; kvbm disabled", name)
            return None
        this_page = t[0].numel() * t.element_size()
        if page not in (None, this_page) or num_blocks not in (None, t.shape[0]):
            log.warning("kvbm: layers differ in page size or block count; kvbm disabled")
            return None
        page, num_blocks, dtype = this_page, t.shape[0], str(t.dtype).replace("torch.", "")
        layers.append(LayerSpec(0, t.data_ptr() - base, t.stride(0) * t.element_size()))
    if not layers or page is None or num_blocks is None:
        return None
    return RegionSpec((memfd,), (size,), tuple(layers), page, num_blocks, dtype,
                      engine_id=f"vllm-{os.getpid()}")


def layer_page_ends(names_by_tensor: Sequence[Sequence[str]], pages_per_block: int) -> dict[str, int]:
    """vLLM layer name -> the end of its pages in a block of the region: tensor ``i`` (in the
    region's order) holds pages ``[i * P / n, (i + 1) * P / n)``. Empty when the pages do not
    split evenly over the tensors (then every layer waits for the whole load)."""
    n = len(names_by_tensor)
    if n == 0 or pages_per_block % n:
        return {}
    per = pages_per_block // n
    return {name: (i + 1) * per for i, names in enumerate(names_by_tensor) for name in names}


class KvbmConnectorWorker:
    """vLLM's worker-side connector hooks, translated for the core.

    Args:
        overlapping_steps: steps vLLM runs at once (2 with asynchronous scheduling).
        ordered_loads: a step's loads are sent only once the GPU ran the earlier steps (vLLM
            schedules the next step while the GPU still runs this one, and a vLLM without
            deferred block frees may have handed a block that step still writes to a request
            that loads into it: issue 17 window 4).
    """

    def __init__(self, worker_id: str, settings: ConnectorSettings, overlapping_steps: int = 1,
                 ordered_loads: bool = False) -> None:
        self.core = WorkerCore(WorkerId(worker_id), settings, overlapping_steps=overlapping_steps)
        self.settings = settings
        self.ordered_loads = ordered_loads
        self.cuda = False
        self.layerwise = settings.load_mode is LoadMode.LAYERWISE
        self._page_ends: dict[str, int] = {}
        self._pages_per_block = 0
        self._pending = False  # layer-pipelined loads of this step not settled yet
        self._hooks_ran = False  # a layer hook of this step's forward ran (it waited for its pages)
        self._waited_end = 0  # pages the forward waited for in this step
        self._waited_s = 0.0
        #: (traced) when the step's forward began, wall and CPU, and whether it loaded ("forward" vs "step_forward")
        self._forward_from: tuple[float, float, bool] | None = None
        self._bound: Any = None  # the last plan whose earlier steps' stores were sent (see bind)

    def set_region(self, spec: RegionSpecLike | None, cuda: bool = False,
                   names_by_tensor: Sequence[Sequence[str]] = ()) -> None:
        """``spec``: a :class:`RegionSpec` (CPU, sealed memfd) or a ``CudaRegionSpec`` (GPU, CUDA IPC);
        ``names_by_tensor``: vLLM's layer names of each of the region's tensors, in its order."""
        self.cuda = cuda
        if spec is not None:
            self._pages_per_block = len(spec.layers)
            self._page_ends = layer_page_ends(names_by_tensor, self._pages_per_block)
            if self.layerwise and not self._page_ends:
                log.warning("kvbm: the KV cache's %d pages per block do not split over its %d layer tensors; "
                            "layer-pipelined loads wait for the whole load before the first layer",
                            self._pages_per_block, len(names_by_tensor))
        self.core.set_region(spec, self._signal_page() if spec is not None and self.layerwise and cuda else None)

    def _signal_page(self) -> EngineSignals | None:
        """The signal page for GPU layer waits, when configured and the GPU supports them."""
        waits = self.settings.gpu_layer_waits
        if waits is GpuWaits.OFF:
            log.info("kvbm: layer waits on the CPU (gpu_layer_waits is false)")
            return None
        import torch
        signals = EngineSignals()
        # every mode but "eager" waits on the GPU under lazy module loading too
        why = signals.enable_gpu(torch.cuda.current_device(), lazy_loading=waits is not GpuWaits.EAGER)
        if why is not None:
            signals.close()
            log.info("kvbm: layer waits on the CPU: %s", why)  # (the default: CUDA loads kernels lazily)
            return None
        log.info("kvbm: layer waits on the GPU (a wait kernel on the signal page)%s",
                 {GpuWaits.TAIL: ": the last layers' only",
                  GpuWaits.AFTER_FIRST: ": those after the first layer group"}.get(waits, ""))
        return signals

    def start_loads(self, meta: KvbmConnectorMetadata) -> None:
        ready = self._earlier_steps_ran if self.cuda and self.ordered_loads else None
        self.settle_layers()  # (a step whose end vLLM did not report: nothing is left pending)
        self.core.start_loads(meta.loads, wait=not self.layerwise, ready=ready)
        self._pending = self.layerwise and bool(meta.loads)
        self._hooks_ran, self._waited_end, self._waited_s = False, 0, 0.0
        self._forward_from = (time.perf_counter(), time.thread_time(), bool(meta.loads)) if tracing() else None

    def wait_layer(self, layer_name: str) -> None:
        """vLLM's ``wait_for_layer_load``: the layer's pages of this step's loads landed."""
        if not self._pending:
            return
        self._hooks_ran = True
        end = self._page_ends.get(layer_name, self._pages_per_block)
        if end <= self._waited_end:
            return
        t0 = time.perf_counter()
        self.core.wait_pages(end, self._pages_per_block)
        self._waited_s += time.perf_counter() - t0
        self._waited_end = end

    def settle_layers(self) -> None:
        """Settle this step's layer-pipelined loads (idempotent): once the forward is enqueued,
        before any store of the step is sent."""
        if not self._pending:
            return
        self._pending = False
        # NOTE: each hook waits for its own layer's pages, so a forward that ran its hooks read
        # no page before it landed. Not "waited for the last page": a drafter's layers (EAGLE,
        # MTP) share the KV cache but run after the step settled, without connector metadata.
        t0 = time.perf_counter()
        self.core.wait_loads(forward_waited=self._hooks_ran)
        if tracing():  # settle_ms: the wait for the daemon's answers once the forward was enqueued
            trace("layer_waits", waited_ms=round(self._waited_s * 1e3, 2), pages=self._waited_end,
                  of=self._pages_per_block, settle_ms=round((time.perf_counter() - t0) * 1e3, 2))

    @staticmethod
    def _earlier_steps_ran() -> None:
        """NOTE: the daemon's copies run on its own CUDA stream, unordered with vLLM's: wait
        until the kernels enqueued so far (the previous step's forward) have run."""
        import torch
        torch.cuda.current_stream().synchronize()

    def bind(self, meta: Any) -> None:
        """vLLM's ``bind_connector_metadata`` (before the step's forward is enqueued): send the
        stores of earlier steps' blocks the plan carries (:attr:`StepPlan.earlier_stores`;
        ordered after the forward that wrote them), then fence if the plan says so (which waits
        for those too: a preempted request's blocks may be rewritten by this step's forward)."""
        if not isinstance(meta, StepPlan):
            return
        if meta.earlier_stores and meta is not self._bound:
            self.settle_layers()  # (an earlier step's failed layer-pipelined load drops these stores)
            self._bound = meta  # (once per plan: a second bind would send the same plans again)
            self.core.start_stores(meta.earlier_stores, self._kv_written() if self.cuda else None)
        self.fence_if_needed(meta)

    def start_stores(self, meta: KvbmConnectorMetadata) -> None:
        """vLLM's ``wait_for_save``: settle the step's layer-pipelined loads, then send the
        step's own stores (those of earlier steps' blocks went at :meth:`bind`)."""
        self.settle_layers()
        if self._forward_from is not None:  # the engine's thread from its loads' start to here, wall and CPU
            wall, cpu, loads = self._forward_from
            self._forward_from = None
            trace("forward" if loads else "step_forward", ms=round((time.perf_counter() - wall) * 1e3, 2),
                  cpu_ms=round((time.thread_time() - cpu) * 1e3, 2))
        if meta.stores:
            self.core.start_stores(meta.stores, self._kv_written() if self.cuda else None)

    @staticmethod
    def _kv_written() -> Callable[[], None]:
        """A wait for the KV enqueued so far (this step's in ``wait_for_save``, the earlier
        steps' in :meth:`bind`). NOTE: vLLM 0.26 schedules asynchronously on a GPU, so these
        hooks run when the forward is only enqueued; the daemon may read the blocks once the
        compute stream passed this event."""
        import torch
        event = torch.cuda.Event()
        event.record()
        return event.synchronize

    def fence_if_needed(self, meta: Any) -> None:
        """Blocks of stores in flight stay allocated (running requests own them; finished ones
        are freed only after ``finished_sending``) except after a preemption: fence then."""
        if isinstance(meta, StepPlan) and meta.fence:  # (KvbmConnectorMetadata is a StepPlan)
            self.core.fence()

    def finished(self, meta: KvbmConnectorMetadata | None) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving) for vLLM's ``get_finished``."""
        self.settle_layers()
        sending, recving = self.core.finished(meta.delayed_frees if meta is not None else ())
        return (set(sending) or None), (set(recving) or None)

    def worker_metadata(self) -> KvbmWorkerMetadata | None:
        """vLLM's ``build_connector_worker_meta`` (after ``get_finished``): the held stores this
        worker settled since the last step, for the scheduler role's block holds."""
        settled = self.core.settled_stores()
        if not settled:
            return None
        from .metadata import KvbmWorkerMetadata
        return KvbmWorkerMetadata(tuple(settled))

    def take_load_errors(self) -> set[EngineBlockId]:
        return self.core.take_load_errors()

    def shutdown(self) -> None:
        self.core.shutdown()
