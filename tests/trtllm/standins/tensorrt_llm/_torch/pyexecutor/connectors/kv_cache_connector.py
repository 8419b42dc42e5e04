"""STAND-IN for ``tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector``: the KV cache
connector interface of TensorRT-LLM's PyTorch backend (the two abstract roles and the data the
runtime hands the scheduler role). Tests only; see ``tests/trtllm/TRTLLM_API.md``.

Roles: the *scheduler* exists on rank 0 only; its answers and its metadata are broadcast to
every rank. A *worker* exists on every rank and moves the bytes of its own KV pool.

Only the interface common to the v1.1 releases and the newer ones is reproduced. Newer releases
add optional fields to :class:`RequestData` (``block_hashes``, ``priorities``, ``cache_salt``,
``new_block_ids_by_layer_group``) and optional methods (``register_kv_cache_layout``,
``update_state_after_alloc_by_layer_group``, ``request_finished_by_layer_group``,
``request_reset``, ``cancel_load``); a connector written against this stand-in uses none of them
and so runs on both.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

if TYPE_CHECKING:
    import torch

    from tensorrt_llm.bindings.internal.batch_manager import LlmRequest
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs


@dataclass
class RequestData:
    """What the runtime reports about one scheduled request before a forward pass.

    Attributes:
        request_id: The request's id (``LlmRequest.request_id``, an int).
        new_tokens: Tokens not reported before: the whole token list the first time a request
            appears, afterwards only the tokens appended since (the sampled ones).
        new_block_ids: Block ids allocated since the last report (all of them the first time,
            device-reused and connector-matched blocks included).
        computed_position: Tokens whose KV is valid before this pass. For a request reported in
            ``new_requests`` the tokens the connector matched are *not* included (the runtime
            subtracts them); for a later context chunk it is ``context_current_position``; for a
            generation step it is ``len(tokens) - 1``.
        num_scheduled_tokens: Tokens this pass computes (the context chunk, or 1).
    """

    request_id: int
    new_tokens: List[int]
    new_block_ids: List[int]
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class SchedulerOutput:
    """Argument of :meth:`KvCacheConnectorScheduler.build_connector_meta`.

    Attributes:
        new_requests: Requests scheduled for the first time (each appears here exactly once; a
            request parked for an asynchronous load is left out until it is scheduled again).
        cached_requests: Requests that appeared in ``new_requests`` before (later context
            chunks and generation steps).
    """

    new_requests: List[RequestData] = field(default_factory=list)
    cached_requests: List[RequestData] = field(default_factory=list)


class KvCacheConnectorWorker(ABC):
    """Worker role: one per rank, moves the bytes of the KV pool it registered.

    ``__init__(llm_args)`` is called on every rank, concurrently with the scheduler's on rank 0.
    """

    def __init__(self, llm_args: "TorchLlmArgs"):
        self._llm_args = llm_args
        self._metadata = None
        super().__init__()

    def bind_connector_meta(self, metadata: object):
        """Receive the scheduler's metadata for the coming pass (before ``start_load_kv``)."""
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self):
        self._metadata = None

    def register_forward_pass_callable(self) -> Optional[Callable]:
        """Optionally return a callable the runtime invokes at the end of each forward pass, on
        the forward pass's stream (e.g. to record an event that says the KV is written)."""
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: "torch.Tensor"):
        """Register this rank's KV pool: one contiguous tensor for all layers, shape
        ``[num_blocks, num_layers, 2 (K, V), num_kv_heads * tokens_per_block * head_dim]``."""

    @abstractmethod
    def start_load_kv(self, stream: "torch.cuda.Stream"):
        """Start the loads the bound metadata asks for, before the forward pass."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: "torch.cuda.Stream"):
        """Called just before layer ``layer_idx``'s work is enqueued on ``stream``."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: "torch.cuda.Stream"):
        """Called just after layer ``layer_idx``'s work is enqueued on ``stream``."""

    @abstractmethod
    def wait_for_save(self, stream: "torch.cuda.Stream"):
        """Called at the end of the forward pass; return once synchronous saves are done."""

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: List[int],
                     started_loading_req_ids: List[int]) -> Tuple[List[int], List[int]]:
        """Called once per executor iteration, whether or not anything was scheduled.

        Args:
            finished_gen_req_ids: Requests newly finished whose ``request_finished`` returned
                True (their blocks stay allocated until they are reported saved). Each id is
                passed exactly once.
            started_loading_req_ids: Requests whose ``get_num_new_matched_tokens`` answered
                asynchronous since the last call. Each id is passed exactly once.

        Returns:
            (ids finished saving, ids finished loading). An id may be returned only after it was
            passed in; the runtime acts on it once every rank has returned it.
        """


class KvCacheConnectorScheduler(ABC):
    """Scheduler role: rank 0 only; its return values are broadcast to every rank."""

    def __init__(self, llm_args: "TorchLlmArgs"):
        self._llm_args = llm_args
        super().__init__()

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        """Return the (picklable) metadata every worker binds before the coming pass."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: "LlmRequest",
                                   num_computed_tokens: int) -> Tuple[int, bool]:
        """How many prompt tokens beyond the ``num_computed_tokens`` the device cache matched
        the connector can provide, and whether it loads them asynchronously. ``(0, True)`` is
        rejected by the runtime."""

    @abstractmethod
    def request_finished(self, request: "LlmRequest", cache_block_ids: List[int]) -> bool:
        """The request finished generating; True delays the free of ``cache_block_ids`` until
        every worker reports the request in the first list ``get_finished`` returns."""

    @abstractmethod
    def update_state_after_alloc(self, request: "LlmRequest", block_ids: List[int]):
        """The blocks of a new request were allocated (all of them, reused ones included)."""

    def wait_for_initialization(self):
        """Newer releases call this once after construction; the default does nothing."""
        return
