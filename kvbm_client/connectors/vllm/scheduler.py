"""Scheduler role of the vLLM connector: vLLM's scheduler hooks over the shared core.

Runs in vLLM's EngineCore process, on the scheduler's thread. Everything engine-independent
(match and pin, early loads, store batching, delayed frees, the leader link) is
:class:`~kvbm_client.connectors.core.SchedulerCore`; this adapter reads vLLM's request and
scheduler output and nothing else.

Loads are synchronous (``load_mode: "sync"``): the hit's tokens count as computed at once, the
worker role copies them in before the step's forward, and the request is prefilled in the same
step; or asynchronous (``"async"``): the request waits in ``WAITING_FOR_REMOTE_KVS`` until the
worker role reports the load done, so other requests' steps never wait for a copy. The default
``"auto"`` is synchronous unless vLLM would recompute a failed synchronous load wrongly (its V2
model runner, or asynchronous scheduling: vllm#49250; see :func:`.compat.auto_load_mode`).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

from ...hashing import MultimodalSpan, RequestExtras
from ...ids import EngineBlockId
from ..core.block_holds import BlockHolds
from ..core.early_loads import EarlyLoads, early_loads_decision
from ..core.leader_link import LeaderLink, LeaderPort
from ..core.request_keys import EngineRequest
from ..core.scheduler import SchedulerCore
from ..core.settings import ConnectorSettings
from ..core.store_planner import StorePlanner
from .metadata import KvbmConnectorMetadata

log = logging.getLogger("kvbm.connector")


def request_extras(request: Any) -> RequestExtras | None:
    """What besides its tokens decides a vLLM (0.26 - 0.32) request's KV, as vLLM's own block
    hashes fold it (``generate_block_hash_extra_keys``); None for prompt embeddings (their
    token ids are placeholders, so kvbm leaves such requests alone)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    multimodal = multimodal_spans(request)
    if multimodal is None:
        return None
    lora = getattr(request, "lora_request", None)
    if not lora:
        return RequestExtras(cache_salt=getattr(request, "cache_salt", None) or None, multimodal=multimodal)
    return RequestExtras(cache_salt=getattr(request, "cache_salt", None) or None, lora_name=str(lora.lora_name),
                         lora_path=getattr(lora, "lora_path", None) or None, multimodal=multimodal)


def multimodal_spans(request: Any) -> tuple[MultimodalSpan, ...] | None:
    """The request's multimodal inputs, sorted by position (``mm_features``; older vLLM:
    ``mm_hashes`` with ``mm_positions``); None when one has no content hash."""
    features = getattr(request, "mm_features", None) or ()
    if features:
        pairs = [(f.identifier, f.mm_position) for f in features]
    else:
        hashes, positions = getattr(request, "mm_hashes", None) or (), getattr(request, "mm_positions", None) or ()
        if len(hashes) != len(positions):
            return None
        pairs = list(zip(hashes, positions))
    if any(identifier is None for identifier, _ in pairs):
        return None
    spans = (MultimodalSpan(str(identifier), int(pos.offset), int(pos.length)) for identifier, pos in pairs)
    return tuple(sorted(spans, key=lambda s: s.offset))


class KvbmConnectorScheduler:
    """vLLM's scheduler-side connector hooks, translated for the core.

    Args:
        leader: the leader link (default: a :class:`LeaderLink` to ``settings.leader_address``;
            tests pass a fake).
        store_leader: with ``settings.async_store_plans``, the store planner's own link (default:
            a second :class:`LeaderLink`, or ``leader`` when a fake is passed).
        overlapping_steps: steps vLLM runs at once (2 with asynchronous scheduling).
        defers_block_frees: vLLM keeps a freed or preempted request's blocks out of its pool
            until the steps in flight that may write them have run (:func:`.compat.defers_block_frees`).
            With overlapping steps, loads start early only then: else the next step may be given
            a block the step in flight still writes (issue 17 window 4); the core also keeps them
            off while a step in flight fenced.
    """

    def __init__(self, block_size: int, settings: ConnectorSettings, worker_ids: Sequence[str] | None = None,
                 leader: LeaderPort | None = None, overlapping_steps: int = 1, defers_block_frees: bool = False,
                 store_leader: LeaderPort | None = None) -> None:
        self.early_loads, why = early_loads_decision(settings.early_loads, bool(worker_ids), overlapping_steps,
                                                     defers_block_frees)
        log.info("kvbm: early loads %s (%s)", "on" if self.early_loads else "off", why)
        early = EarlyLoads(settings, worker_ids) if self.early_loads and worker_ids else None
        planner = None
        if settings.async_store_plans:
            planner = StorePlanner(store_leader or leader or LeaderLink(settings, "vllm-stores"),
                                   wait_s=4 * settings.timeout_s + 1.0, min_keys=settings.async_store_min_blocks,
                                   without_loads=settings.async_decode_store_plans)
        self.core = SchedulerCore(block_size, settings, leader or LeaderLink(settings, "vllm-scheduler"),
                                  request_extras, early, overlapping_steps=overlapping_steps, store_planner=planner)

    def get_num_new_matched_tokens(self, request: EngineRequest, num_computed_tokens: int) -> tuple[int, bool]:
        return self.core.lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if not self.core.pending_load(request.request_id):
            return
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self.core.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvbmConnectorMetadata:
        so = scheduler_output
        for new in so.scheduled_new_reqs:
            self.core.assign_blocks(new.req_id, new.block_ids[0], replace=True)
        cached = so.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                self.core.assign_blocks(req_id, new_ids[0], replace=req_id in resumed)
        computed = {}
        for req_id, num_new in so.num_scheduled_tokens.items():
            request = self.core.request(req_id)
            if request is not None:
                computed[req_id] = request.num_computed_tokens + num_new  # type: ignore[attr-defined]
        plan = self.core.step(computed, getattr(so, "preempted_req_ids", None) or (),
                              num_tokens=int(getattr(so, "total_num_scheduled_tokens", 0) or 0))
        return KvbmConnectorMetadata.of(plan)

    def bind_block_pool(self, pool: Any, reporters: int) -> None:
        """vLLM's ``bind_gpu_block_pool`` (>= 0.26): hold the blocks stores read in vLLM's pool
        (``reporters``: the worker roles that report each store) instead of delaying frees."""
        self.core.holds = BlockHolds(PoolPins(pool), reporters)
        log.info("kvbm: a finished request's blocks are freed at once; those stores still read stay pinned "
                 "(%d worker report(s) per store)", reporters)

    def update_connector_output(self, connector_output: Any) -> None:
        """A step's output came back: the end of its time for the prefill meter, and the held
        stores the worker roles settled."""
        self.core.step_done()
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        settled = getattr(meta, "settled_stores", None)
        if settled:
            self.core.stores_settled(settled)

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while blocks are held: the worker roles' reports come with steps."""
        return self.core.holding

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        # True: keep the blocks until the worker role confirms its stores read them.
        return self.core.finished(request.request_id), None

    def shutdown(self) -> None:
        self.core.shutdown()


class PoolPins:
    """vLLM's ``BlockPool`` as :class:`~kvbm_client.connectors.core.block_holds.BlockPins`: a
    pin is a reference (``touch``: a free block leaves the free queue), an unpin drops it
    (``free_blocks``: a block with none left goes back to the free queue, its cached prefix
    intact, tail first as vLLM frees a request's blocks)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def pin(self, blocks: Sequence[EngineBlockId]) -> None:
        self._pool.touch([self._pool.blocks[b] for b in blocks])

    def unpin(self, blocks: Sequence[EngineBlockId]) -> None:
        self._pool.free_blocks([self._pool.blocks[b] for b in reversed(blocks)])
