"""Store plans asked for off the scheduler's thread: a step's ``PrepareStore`` runs while the
engine runs the step, and the plan ships with the next step.

The leader's ``PrepareStore`` for a 20K-token prefill (1024 new blocks) takes 3-7 ms, and hashing
its blocks 1.5-4 ms more (a cold request's lookup that the leader's presence filter answers hashes
none); on the scheduler's thread both delay every step that completes blocks, a cold prefill's
TTFT included.
:class:`StorePlanner` asks for it on its own thread, over its own leader session, and the
scheduler core collects the answer when it builds the next step (by then the step's forward
has run for at least the time it takes the engine to schedule again; the collection waits for
an answer still on its way, bounded by the session's timeout).

Why a block's bytes are still what its key says when the store ships a step late (the
scheduler core keeps each of these; see the ordering notes in :mod:`kvbm_client.connectors.core`):

* the blocks were complete (full blocks, immutable while a request holds them) when the step
  that computed them was scheduled, and the worker side sends the store when the next step's
  metadata is bound, before that step's forward is enqueued, ordered after the computing
  forward (:attr:`~.specs.StepPlan.earlier_stores`);
* a request with a store planned (answered or not) counts as having stores: finishing, its
  blocks are freed only once the worker side reports its stores done (a delayed free; with block
  holds, the blocks of the store are pinned from the ask until every worker side reported it), and
  preempted, the step that ships or follows the store fences, so the worker side waits for it
  before a forward can rewrite the blocks;
* the next step always ships what this one planned (the collection waits for it): nothing is
  planned two steps back, and an engine that keeps requests with delayed frees, or block holds
  (:mod:`.block_holds`: the blocks of a store asked for are held from the ask), keeps stepping
  (vLLM does), so a plan never waits for a step that does not come.

Owns its leader session (a second one per engine: the scheduler's own :class:`.leader_link.LeaderLink`
is used from the scheduler's thread only) and one thread. Used from the scheduler's thread.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable

from ...handles import TransferHandle
from ...ids import BlockHash, EngineBlockId
from .leader_link import LeaderPort
from .specs import RequestId, StoreSpec
from .tracing import trace, tracing

log = logging.getLogger("kvbm.connector")


def store_spec(handle: TransferHandle | None, blocks: list[EngineBlockId],
               owners: list[RequestId]) -> StoreSpec | None:
    """The stores a leader's ``PrepareStore`` answer planned (entry i of the request: block
    ``blocks[i]`` of request ``owners[i]``); None when it planned none or could not be asked."""
    if handle is None or handle.is_empty:
        return None
    assert handle.signed is not None, "a non-empty store handle carries its signed plan"
    picked = [owners[i] for i in handle.indices]
    log.debug("kvbm store: %d of %d new blocks planned", len(picked), len(blocks))
    return StoreSpec(handle.signed.plan, handle.signed.signature, [blocks[i] for i in handle.indices], picked,
                     deadline=handle.deadline)


#: how to hash a step's keys, called on the planner's thread (None: not keyable, store nothing)
Keys = Callable[[], "list[BlockHash] | None"]


@dataclass
class _Asked:
    """One step's stores, asked for and not collected yet."""

    future: "Future[TransferHandle | None]"
    blocks: list[EngineBlockId]
    owners: list[RequestId]
    asked_at: float


class StorePlanner:
    """At most one step's ``PrepareStore`` in flight (:meth:`submit`), collected by the next
    step (:meth:`collect`).

    Args:
        leader: this planner's own leader link (called from its thread only).
        min_keys: the fewest new blocks a step must have for its plan to be asked for here
            (the vLLM connector's: ``async_store_min_blocks``, see
            :data:`.settings.DEFAULT_ASYNC_STORE_MIN_BLOCKS`); the scheduler core plans smaller
            steps on its own thread (with ``without_loads``, only those that load).
        without_loads: a step that loads nothing is planned here whatever its number of new
            blocks (``async_decode_store_plans``): no load's copy hides its round trip on the
            scheduler's thread, and no load's forward competes with this thread for the GIL.
        wait_s: how long :meth:`collect` waits for an answer still on its way (the leader
            link's own timeout, with one retry, bounds the call itself; this is a backstop).
    """

    def __init__(self, leader: LeaderPort, wait_s: float = 10.0, min_keys: int = 1,
                 without_loads: bool = False) -> None:
        self._leader = leader
        self.min_keys = max(1, min_keys)
        self.without_loads = without_loads
        self._wait_s = wait_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvbm-store-plan")
        self._asked: _Asked | None = None

    def takes(self, num_keys: int, loading: bool) -> bool:
        """Whether a step with ``num_keys`` new blocks (``loading``: and a load) is planned here."""
        return num_keys >= self.min_keys or (self.without_loads and not loading and num_keys > 0)

    def submit(self, keys: Keys, blocks: list[EngineBlockId], owners: list[RequestId]) -> None:
        """Ask for the stores of the blocks ``keys()`` keys (entry i: block ``blocks[i]`` of request
        ``owners[i]``), calling it on the planner's thread: the blocks are hashed there, off the
        scheduler's (None from it: nothing to store). The previous step's must have been collected."""
        assert self._asked is None, "collect() the previous step's stores first"
        self._asked = _Asked(self._thread.submit(self._ask, keys), blocks, owners, time.perf_counter())

    def _ask(self, keys: Keys) -> TransferHandle | None:
        t0 = time.perf_counter()
        try:
            hashed = keys()
            t1 = time.perf_counter()
            if hashed is None:
                return None
            handle = self._leader.prepare_store(hashed)
        except Exception:  # never fail the engine: a link bug is a skipped store, logged
            log.exception("kvbm: planning a step's stores failed; they are skipped")
            return None
        if tracing():
            trace("prepare_store", keys=len(hashed), ms=round((time.perf_counter() - t1) * 1e3, 2),
                  hash_ms=round((t1 - t0) * 1e3, 3), planned_async=True)
        return handle

    @property
    def pending(self) -> bool:
        """A step's stores were asked for and not collected yet."""
        return self._asked is not None

    def collect(self) -> StoreSpec | None:
        """The previous step's stores (None: nothing to store, the leader skipped them all or
        could not be asked)."""
        asked, self._asked = self._asked, None
        if asked is None:
            return None
        t0 = time.perf_counter()
        try:
            handle = asked.future.result(timeout=self._wait_s)
        except FutureTimeout:
            # NOTE: the plan may still be issued later; unshipped, it expires at the leader (its
            # slots return after the job timeout) and the blocks are not offered again.
            log.warning("kvbm: the leader did not plan %d stores within %gs; they are skipped", len(asked.blocks),
                        self._wait_s)
            return None
        if tracing():
            trace("store_plan_collected", wait_ms=round((time.perf_counter() - t0) * 1e3, 2),
                  age_ms=round((time.perf_counter() - asked.asked_at) * 1e3, 2),
                  planned=handle.num_blocks if handle is not None else 0)
        return store_spec(handle, asked.blocks, asked.owners)

    def close(self) -> None:
        """Give back a plan that will not ship, stop the thread, close the leader link."""
        asked, self._asked = self._asked, None
        if asked is not None:
            try:
                handle = asked.future.result(timeout=self._wait_s)
            except FutureTimeout:
                handle = None
            if handle is not None and not handle.is_empty:
                try:
                    self._thread.submit(self._leader.release, handle).result()
                except Exception:  # best effort: an unshipped plan expires at the leader anyway
                    log.debug("kvbm: releasing an unshipped store plan failed", exc_info=True)
        self._thread.shutdown(wait=True)
        self._leader.close()
