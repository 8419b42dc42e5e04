"""Worker role of the TensorRT-LLM connector: TensorRT-LLM's worker hooks over the shared core.

Runs on every rank, on the executor's thread, beside that rank's kvbm worker daemon (worker id
= rank). Everything engine-independent (the region kept registered, loads and stores in flight,
fences, load errors) is :class:`~kvbm_client.connectors.core.WorkerCore`; this adapter
describes TensorRT-LLM's KV pool (:mod:`.kv_region`) and maps its hooks:

* ``start_load_kv``: fence if the step's plan says so, then send the step's loads (without the
  overlap scheduler the scheduler role usually started them already; the daemon joins the copy).
  Under the overlap scheduler (TensorRT-LLM's default) a GPU load is sent only once the forward
  stream ran the iteration before: TensorRT-LLM frees a finished request's blocks while that
  iteration, which may still write them, runs, and the daemon copies on a stream of its own;
* ``wait_for_layer_load`` (first layer of the pass): wait for the synchronous loads. TensorRT-LLM
  has no way to recompute a block whose load failed (its ``get_finished`` returns two id lists,
  nothing else), so a failed load - synchronous, or an asynchronous one reported loaded since -
  **raises** here: TensorRT-LLM fails the active requests and a client's retry recomputes them.
  Stores in flight are waited for first, because TensorRT-LLM frees those requests' blocks;
* ``wait_for_save``: send the step's stores (on a GPU, after a CUDA event recorded on the
  forward's stream, from a helper thread);
* ``get_finished`` (every iteration): requests whose stores are done among the finished ones
  TensorRT-LLM handed in (``finished_gen_req_ids`` is the delayed-free list; the plan's own
  ``delayed_frees`` is not used), and asynchronous loads done, each returned once and only
  after TensorRT-LLM handed its id in (:class:`AsyncIds`). A pass that started and never reached
  ``wait_for_save`` raised: its requests' blocks are free, so every store in flight is waited for.

Only ``wait_for_layer_load`` and ``wait_for_save`` ever raise.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable

from ...errors import KvbmTransferError
from ...ids import WorkerId
from ...logs import attach_engine_logging
from ..core.specs import RequestId, StepPlan
from ..core.worker import WorkerCore
from .compat import KvCacheConnectorWorker
from .kv_region import describe_kv_cache
from .settings import trtllm_settings

log = logging.getLogger("kvbm.connector")


class AsyncIds:
    """TensorRT-LLM's ids of one rank's asynchronous requests (pure bookkeeping).

    Invariants: an id is returned at most once, and only after TensorRT-LLM passed it in
    (``finished_gen_req_ids`` / ``started_loading_req_ids``), since TensorRT-LLM crashes on any
    other; a finished request is not returned as saved while its asynchronous load may still
    write into its blocks (a request cancelled while parked for its load).
    """

    def __init__(self) -> None:
        self._saving: dict[RequestId, int] = {}
        self._loading: dict[RequestId, int] = {}
        self._loaded: set[RequestId] = set()  # done before TensorRT-LLM named them
        self._sent: set[RequestId] = set()  # stores done, held back by a load in flight

    def passed(self, finished_gen_req_ids: Iterable[int], started_loading_req_ids: Iterable[int]) -> list[RequestId]:
        """Record the ids handed in; returns the finished ones (the core's delayed frees)."""
        finished = []
        for rid in finished_gen_req_ids:
            finished.append(RequestId(str(rid)))
            self._saving[finished[-1]] = rid
        for rid in started_loading_req_ids:
            self._loading[RequestId(str(rid))] = rid
        return finished

    def report(self, sent: Iterable[RequestId], loaded: Iterable[RequestId]) -> tuple[list[int], list[int]]:
        """``get_finished``'s answer, given what the core reports done now."""
        self._loaded.update(loaded)
        ready = [r for r in self._loaded if r in self._loading]
        self._loaded.difference_update(ready)
        loaded_ids = [self._loading.pop(r) for r in ready]
        self._sent.update(r for r in sent if r in self._saving)
        done = [r for r in self._sent if r not in self._loading]
        self._sent.difference_update(done)
        return [self._saving.pop(r) for r in done], loaded_ids


class KvbmConnectorWorker(KvCacheConnectorWorker):
    """TensorRT-LLM's ``KvCacheConnectorWorker`` over kvbm (one per rank).

    Args:
        llm_args: TensorRT-LLM's ``TorchLlmArgs`` (the only argument TensorRT-LLM passes).
        core: the worker core (default: one for this rank's worker daemon; tests pass their own).
    """

    def __init__(self, llm_args: Any, core: WorkerCore | None = None) -> None:
        super().__init__(llm_args)
        attach_engine_logging()
        settings = trtllm_settings(llm_args)
        self.rank = settings.rank
        self.overlap_scheduler = settings.overlap_scheduler
        self.core = core or WorkerCore(WorkerId(settings.worker_id), settings.core,
                                       overlapping_steps=settings.overlapping_steps)
        self.kv_cache_tensor: Any = None  # kept alive while the daemon addresses it
        self._ids = AsyncIds()
        self._loaded_plan: StepPlan | None = None  # the plan whose loads were sent
        self._stored_plan: StepPlan | None = None  # the plan whose stores were sent
        self._pass_open = False  # start_load_kv ran, wait_for_save not yet
        self._loads_checked = True

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        self.kv_cache_tensor = kv_cache_tensor
        try:
            spec = describe_kv_cache(kv_cache_tensor, engine_id=f"trtllm-{os.getpid()}-r{self.rank}")
        except ValueError as exc:
            log.warning("kvbm: cannot describe TensorRT-LLM's KV pool (%s)", exc)
            spec = None
        self.core.set_region(spec)

    # ------------------------------------------------------------------ the pass
    def start_load_kv(self, stream: Any) -> None:
        self._pass_open, self._loads_checked = True, False
        plan = self._plan()
        if plan is None or plan is self._loaded_plan:
            return
        self._loaded_plan = plan
        if plan.fence:
            self.core.fence()
        self.core.start_loads(plan.loads, wait=False, ready=self._earlier_iterations_ran(stream))

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        if not self._loads_checked:
            self._check_loads()

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        return None  # whole blocks are stored once the pass wrote every layer

    def wait_for_save(self, stream: Any) -> None:
        if not self._loads_checked:
            self._check_loads()
        self._pass_open = False
        plan = self._plan()
        if plan is None or plan is self._stored_plan or not plan.stores:
            return
        self._stored_plan = plan
        self.core.start_stores(plan.stores, self._kv_written(stream))

    def _check_loads(self) -> None:
        self._loads_checked = True
        self.core.wait_loads()
        failed = self.core.take_load_errors()
        if failed:
            self.core.fence()  # TensorRT-LLM frees the failed requests' blocks: no store may still read them
            raise KvbmTransferError(f"kvbm worker {self.core.worker_id}: {len(failed)} blocks could not be loaded "
                                    f"(e.g. engine block {min(failed)}); the requests fail and are recomputed on retry")

    def _earlier_iterations_ran(self, stream: Any) -> Callable[[], None] | None:
        """A wait until the forward stream ran what was enqueued before this pass (the previous
        iteration), for loads under the overlap scheduler on a GPU; None where nothing runs
        behind the executor's back (the CPU, or one iteration at a time)."""
        if not self.overlap_scheduler or self.kv_cache_tensor is None or not self.kv_cache_tensor.is_cuda:
            return None
        if stream is None:  # (TensorRT-LLM passes its forward stream; never raise from this hook)
            import torch
            stream = torch.cuda.current_stream()
        return stream.synchronize

    def _kv_written(self, stream: Any) -> Callable[[], None] | None:
        """A wait for this pass's KV: None on the CPU (written when the hook runs); on a GPU a CUDA
        event recorded on the forward's stream (TensorRT-LLM enqueues the pass asynchronously)."""
        if self.kv_cache_tensor is None or not self.kv_cache_tensor.is_cuda:
            return None
        import torch
        event = torch.cuda.Event()
        event.record(stream)
        return event.synchronize

    def _plan(self) -> StepPlan | None:
        meta = self.get_connector_meta()
        return meta if isinstance(meta, StepPlan) else None

    # ------------------------------------------------------------------ every iteration
    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        if self._pass_open:  # the pass raised: TensorRT-LLM freed its requests' blocks
            self._pass_open = False
            self.core.fence()
        finished = self._ids.passed(finished_gen_req_ids, started_loading_req_ids)
        sent, loaded = self.core.finished(finished)
        return self._ids.report(sent, loaded)

    def shutdown(self) -> None:
        """Wait for the stores in flight and unregister the KV pool (the driver and tests call it)."""
        self.core.shutdown()
