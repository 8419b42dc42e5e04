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
    plan = core.step({req_id: tokens_computed}, preempted=[...], num_tokens=n)  # stores, fence
    core.step_done()                                                   # its output came back (prefill meter)
    keep_blocks = core.finished(req_id)                                # delay the frees? (not with core.holds)
    core.stores_settled(store_ids)                                     # the worker sides' reports (holds)

Worker side (one per GPU / rank)::

    core = WorkerCore(worker_id, settings)
    core.set_region(spec)                         # RegionSpec (sealed memfds) or CudaRegionSpec
    if plan.fence: core.fence()
    core.start_loads(plan.loads)                  # waits for the synchronous ones
    # layer-pipelined: start_loads(plan.loads, wait=False); wait_pages(end, P) before each
    # layer's forward; wait_loads(forward_waited) once the forward is enqueued
    core.start_stores(plan.stores, ready=event.synchronize)
    sent, loaded = core.finished(plan.delayed_frees)
    store_ids = core.settled_stores()             # held stores settled: to the scheduler side
    failed_blocks = core.take_load_errors()       # the engine recomputes them

Both sides of one engine share ``settings.engine_id``: the worker side publishes the id of
each region it registers there (a 0600 file, :mod:`.region_ids`) and the scheduler side's
early loads read it; no daemon ever shows a region id.

Blocks are keyed by kvbm's own identity (:class:`~kvbm_client.hashing.BlockIdentity`), the
same in every process, so restarted and sibling engines hit each other's blocks.

Ordering: why the engine never reads wrong KV (issue 17)
--------------------------------------------------------
Times are the node's CLOCK_MONOTONIC (the engine, the leader and the worker daemons share a
node). A plan's deadline ``D`` is the leader's: issue time + ``DYN_KVBM_JOB_TIMEOUT_SECS``;
specs carry it (:attr:`LoadSpec.deadline`).

The daemons guarantee:

* (W1) No copy of a job starts after ``D``: the worker asks the leader first
  (``StartTransfer``) and checks the time again when its lane reaches the job; a job of a
  leader that has been replaced starts neither (a new leader numbers its jobs from 1 again).
* (W2) A transfer's copy (engine memory <-> G2/G3) stops at ``D``: the time is checked before
  each chunk, and a load that finished reading its slots after ``D`` fails. A daemon that runs
  touches the engine's memory no later than ``D`` plus one chunk.
* (W3) A daemon answers a ``Transfer`` only once the job's copy has ended; a second call of
  the same plan (the early load and the worker side's own) joins the job and gets its answer.
  UNAVAILABLE means the daemon is going away; a failure while it lives is ABORTED or another
  code, so the worker side keeps its region.
* (L1) The leader rolls back a STORE reported after ``D``: bytes its copy read then are never
  served.
* (L2) Every write into a G2/G3 slot runs on the worker's store lane, one job after the other:
  a late copy never overwrites the bytes of a block stored after it, and a load that read a
  slot after its deadline fails (W2). A worker reports a job only to the leader that issued it,
  and drains its copies before it takes a new pool epoch.

The connector guarantees, in return:

* (C1) A call is waited for until ``D`` + :data:`~.worker.ANSWER_MARGIN_S`, never less (a
  fixed 30 s let a store be committed after the engine reused its blocks when the job timeout
  was longer), never much more (the engine must not hang).
* (C2) A block is never handed back to the engine (a finished request's blocks freed, a
  preempted request's blocks rewritten by the step after the fence) while a copy may still
  touch it. A store answered, or unanswered at ``D`` + margin: what its copy reads later is
  reported after ``D`` and rolled back (L1), so reusing the blocks is safe. A load answered;
  or unanswered at ``D`` + margin: the daemon has not run for the margin past the point where
  any copy of it had to stop (W2), so it is stopped, frozen or gone, and a copy it resumes
  could land later. The worker side then kills it (SIGKILL through a pidfd of the process
  listening on the worker socket; the supervisor restarts it) and waits until it is gone
  before the load counts as failed: the late copy is cancelled, never raced. Without a
  process to hold (a TCP address) it waits for the daemon's answer instead.
* (C3) A load never lands in a block the engine gave to another request: its blocks belong
  to its request until the load settled (C2) - a synchronous load settles before the step's
  forward (a layer-pipelined one before the step's stores, once the forward waited for each
  layer's pages), an asynchronous one before the request leaves its wait (an aborted request keeps
  its blocks until then, vLLM's rule). And it lands exactly in the blocks the engine counts as
  loaded: ``[local, local + n)`` of the lookup the engine acted on (a plan held for another
  local prefix, or past its deadline, is released and planned again).
* (C2') A store planned off the scheduler's thread (:mod:`.store_planner`) ships with the next
  step and is sent before that step's forward, ordered after the forward that wrote its blocks.
  Its requests count as having stores from the moment it is asked for: one that finishes keeps
  its blocks until the worker side reports the store done (C2), one that is preempted fences the
  step that ships the store (the fence, after the send, waits for it). Full blocks are not
  rewritten while a request holds them, so the bytes it reads are still those of its keys.
* (C2'') With block holds (:mod:`.block_holds`, vLLM's block pool): every block of a store is
  pinned in the engine's pool, on the scheduler's thread, from the moment the store is asked for
  (before the engine can free or preempt its request) until every worker side reported the
  store settled (answered, failed, or dropped unsent) or ``D`` + margin passed (C2); a finished
  request is then freed at once, since the engine cannot hand a pinned block to another request.
* (C4) Blocks computed over a failed synchronous load (the step's forward read pages that were
  never loaded) are not stored: the worker side drops the stores of that step and of the steps
  overlapping it (2 with vLLM's asynchronous scheduling), a step late as well (C2').

What the engine waits for, and how long: a synchronous load, until its ``D`` + margin (plus
up to :data:`~.worker.KILL_WAIT_S` to see a killed daemon gone); a fence and a delayed free,
the stores in flight, each until its ``D`` + margin. With the default 30 s job timeout a
step waits at most ~35 s (~40 s with a kill), and only while a daemon does not answer; a
daemon that is down refuses the connection at once.
"""
from ...hashing import MultimodalSpan, RequestExtras
from .early_loads import EarlyLoads
from .leader_link import LeaderLink, LeaderPort
from .region_link import RegionLink
from .request_keys import EngineRequest, RequestState
from .scheduler import SchedulerCore
from .settings import Backoff, ConnectorSettings, LoadMode
from .specs import LoadSpec, RequestId, StepPlan, StoreSpec
from .transfers import InFlight, TransferTracker
from .worker import WorkerCore

__all__ = ["Backoff", "ConnectorSettings", "EarlyLoads", "EngineRequest", "InFlight", "LeaderLink", "LeaderPort",
           "LoadMode", "LoadSpec", "MultimodalSpan", "RegionLink", "RequestExtras", "RequestId", "RequestState",
           "SchedulerCore", "StepPlan", "StoreSpec", "TransferTracker", "WorkerCore"]
