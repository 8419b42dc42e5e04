"""The engine-independent core under kvbm's engine connectors (vLLM, TensorRT-LLM).

An engine connector is two thin adapters over this core: its scheduler class translates the
engine's scheduler hooks into :class:`SchedulerCore` calls, its worker class translates the
worker hooks into :class:`WorkerCore` calls, and the :class:`StepPlan` the scheduler core
returns each step travels to every worker (pickled by the engine, inside its own connector
metadata type). A fix here is a fix for every engine.

Scheduler side (one per engine, on its scheduler thread)::

    core = SchedulerCore(block_size, settings, LeaderLink(settings), extras_of, EarlyLoads(...))
    tokens, asynchronous = core.lookup(request, num_computed_tokens)   # match + pin
    core.allocated(req_id, block_ids, num_external_tokens)             # plan the load
    core.assign_blocks(req_id, new_block_ids, replace=False)           # block table grew
    plan = core.step({req_id: tokens_computed}, preempted=[...])       # stores, fence
    keep_blocks = core.finished(req_id)                                # delay the frees?

Worker side (one per GPU / rank)::

    core = WorkerCore(worker_id, settings)
    core.set_region(spec)                         # RegionSpec (sealed memfds) or CudaRegionSpec
    if plan.fence: core.fence()
    core.start_loads(plan.loads)                  # waits for the synchronous ones
    core.start_stores(plan.stores, ready=event.synchronize)
    sent, loaded = core.finished(plan.delayed_frees)
    failed_blocks = core.take_load_errors()       # the engine recomputes them

Both sides of one engine share ``settings.engine_id``: the worker side publishes the id of
each region it registers there (a 0600 file, :mod:`.region_ids`) and the scheduler side's
early loads read it; no daemon ever shows a region id.

Blocks are keyed by kvbm's own identity (:class:`~kvbm_client.hashing.BlockIdentity`), the
same in every process, so restarted and sibling engines hit each other's blocks.
"""
from ...hashing import MultimodalSpan, RequestExtras
from .early_loads import EarlyLoads
from .leader_link import LeaderLink, LeaderPort
from .region_link import RegionLink
from .scheduler import EngineRequest, RequestState, SchedulerCore
from .settings import Backoff, ConnectorSettings, LoadMode
from .specs import LoadSpec, RequestId, StepPlan, StoreSpec
from .transfers import InFlight, TransferTracker
from .worker import WorkerCore

__all__ = ["Backoff", "ConnectorSettings", "EarlyLoads", "EngineRequest", "InFlight", "LeaderLink", "LeaderPort",
           "LoadMode", "LoadSpec", "MultimodalSpan", "RegionLink", "RequestExtras", "RequestId", "RequestState",
           "SchedulerCore", "StepPlan", "StoreSpec", "TransferTracker", "WorkerCore"]
