"""What a connector's scheduler side tells its worker side each engine step.

Plain dataclasses of bytes and ints: engines pickle them between processes (vLLM's
EngineCore → workers; TensorRT-LLM's rank 0 → every rank).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

from ...ids import EngineBlockId

#: An engine's id of a request (adapters turn non-string ids into strings).
RequestId = NewType("RequestId", str)


@dataclass
class LoadSpec:
    """Onboard a request's external prefix: the leader's signed plan and the engine blocks."""

    req_id: RequestId
    plan: bytes
    signature: bytes
    engine_blocks: list[EngineBlockId]
    #: loaded before this step's forward (the engine counted the tokens as computed); else the
    #: request waits until the worker side reports the load finished.
    sync: bool = False
    #: the plan's deadline (the node's CLOCK_MONOTONIC seconds; 0: unknown): the worker side
    #: waits for the copy until then plus a margin (see :mod:`kvbm_client.connectors.core`).
    deadline: float = 0.0
    #: > 1: a synchronous load copied in this many layer groups, each waited for by the
    #: forward of its layers (``load_mode`` layerwise); 0: whole blocks
    layer_groups: int = 0


@dataclass
class StoreSpec:
    """Offload newly computed blocks of one step (several requests in one plan)."""

    plan: bytes
    signature: bytes
    engine_blocks: list[EngineBlockId]
    #: owner of each entry of ``engine_blocks``
    req_ids: list[RequestId]
    #: the plan's deadline, as :attr:`LoadSpec.deadline`
    deadline: float = 0.0
    #: > 0: the scheduler side holds ``engine_blocks`` in the engine's pool until every worker
    #: side reported this store settled (:mod:`.block_holds`); 0: not held (the request's blocks
    #: wait for its stores: a delayed free)
    store_id: int = 0


@dataclass
class StepPlan:
    """Everything kvbm does in one engine step (the body of the engine's connector metadata)."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    #: finished requests whose blocks stay allocated until their stores are done (the worker
    #: side reports them as finished sending); none when the scheduler side holds the stored
    #: blocks instead (:mod:`.block_holds`).
    delayed_frees: list[RequestId] = field(default_factory=list)
    #: a request with stores in flight was preempted (its blocks are free again): the worker
    #: side waits for every store in flight before this step's forward can rewrite them.
    fence: bool = False
    #: stores of blocks an earlier step's forward wrote (the scheduler side planned them while
    #: that step ran, :mod:`.store_planner`): the worker side sends them when it binds this plan,
    #: before this step's forward is enqueued (and before the fence, which then waits for them
    #: too); ``stores`` read this step's blocks and are sent once its KV is written
    earlier_stores: list[StoreSpec] = field(default_factory=list)
