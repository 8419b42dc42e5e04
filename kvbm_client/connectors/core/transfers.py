"""Bookkeeping of a connector worker side's transfers in flight (pure: no I/O of its own).

Runs in an engine worker process, on the engine's thread. Owns every load and store that
was sent to the worker daemon and not settled yet, the engine blocks whose load failed, and
the finished requests whose blocks wait for their stores. "Settling" a transfer waits for
its future (a gRPC future, or a thread's future for stores sent after a CUDA event); the
tracker decides when to wait and what an outcome means, the caller's callbacks do the rest
(drop a lost daemon's region, trace).

Invariants:
* a request is reported finished loading exactly once, after its load settled; a load that
  failed (or was never sent) has its engine blocks in :meth:`TransferTracker.take_load_errors`
  by then, so the engine recomputes them;
* a load that got no answer from the daemon (our own deadline passed, or the connection
  broke) settles only after ``on_unanswered`` returned: the caller makes sure no copy of the
  daemon can still write its blocks (it stops the daemon) before they count as failed;
* a finished request is reported finished sending only when none of its stores is in flight
  (the engine frees its blocks then, and no store reads a reused block);
* after :meth:`TransferTracker.fence` no store is in flight;
* a layer-pipelined load (:class:`~.layerwise.LayerwiseCall`) counts as failed when it
  failed at any point, also after some of its pages landed, and when the engine's forward
  did not wait for all of its pages (``settle_sync_loads(forward_waited=False)``): the
  forward may have read pages before they landed.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import grpc

from ...ids import EngineBlockId
from .layerwise import LayerwiseCall
from .specs import RequestId

log = logging.getLogger("kvbm.connector")


class TransferFuture(Protocol):
    """A transfer's answer to come (``grpc.Future``, ``concurrent.futures.Future``, or a
    layer-pipelined load's :class:`~.layerwise.LayerwiseCall`)."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any: ...


@dataclass
class InFlight:
    """One transfer sent to the worker daemon (``future`` None: it could not be sent)."""

    future: TransferFuture | None
    req_ids: list[RequestId]
    engine_blocks: list[EngineBlockId]
    submitted: float  # time.monotonic() when sent
    answer_by: float = float("inf")  # time.monotonic() when the call's own deadline passes
    #: sends the same call again, answered by the given time (a second call of a plan joins its job)
    retry: "Callable[[float], TransferFuture | None] | None" = None
    completed: float = 0.0  # time.monotonic() when the future completed (0: not yet)
    store_id: int = 0  # a store's :attr:`~.specs.StoreSpec.store_id` (0: none to report)

    def __post_init__(self) -> None:
        if self.future is not None and hasattr(self.future, "add_done_callback"):
            self.future.add_done_callback(self._stamp)

    def _stamp(self, _future: object) -> None:
        self.completed = time.monotonic()

    @property
    def done(self) -> bool:
        return self.future is None or self.future.done()

    def unanswered(self, exc: BaseException) -> bool:
        """Whether the call failed without the daemon's word on the copy (:func:`unanswered`)."""
        return unanswered(exc, self.answer_by, self.completed or time.monotonic())


def unanswered(exc: BaseException, answer_by: float, completed: float) -> bool:
    """A call that failed with ``exc`` at ``completed`` (CLOCK_MONOTONIC) has no word of the
    daemon on its copy: our own deadline passed (it ended at ``answer_by`` or later), the
    connection broke, or it was cancelled. Else the status is the daemon's own answer."""
    code = exc.code() if isinstance(exc, grpc.RpcError) else None
    if code is None or code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return True
    return code == grpc.StatusCode.DEADLINE_EXCEEDED and completed >= answer_by


#: ``on_load_done(req_id, item, answer, mode)``: a load settled (``answer`` None when it failed).
LoadDone = Callable[[RequestId, InFlight, Any, str], None]


def _ignore_failure(exc: BaseException) -> None:
    return None


def _ignore_load(req_id: RequestId, item: InFlight, answer: Any, mode: str) -> None:
    return None


def _ignore_unanswered(item: InFlight) -> None:
    return None


class TransferTracker:
    """Loads and stores of one worker side, from sent to settled.

    Args:
        on_failure: called with the exception of each failed transfer (the region link
            decides whether the daemon was lost).
        on_load_done: called once per settled load (tracing).
        on_unanswered: called (and waited for) when a load got no answer, before its blocks
            count as failed: it must leave no copy that can still write them.
    """

    def __init__(self, on_failure: Callable[[BaseException], None] = _ignore_failure,
                 on_load_done: LoadDone = _ignore_load,
                 on_unanswered: Callable[[InFlight], None] = _ignore_unanswered) -> None:
        self._on_failure = on_failure
        self._on_load_done = on_load_done
        self._on_unanswered = on_unanswered
        self._loads: dict[RequestId, InFlight] = {}  # asynchronous loads, reported by finished()
        self._sync_loads: list[InFlight] = []  # settled before the step's stores (whole ones: before its forward)
        self._stores: list[InFlight] = []
        self._store_refs: dict[RequestId, int] = {}  # stores in flight per request
        self._settled_stores: list[int] = []  # store ids settled since the last take_settled_stores()
        self._awaiting_send: set[RequestId] = set()  # finished requests whose frees wait
        self._load_errors: set[EngineBlockId] = set()
        self._sync_failed = False  # a layerwise load of this step failed (settled) before the step's end

    # ------------------------------------------------------------------ loads
    def load_sent(self, req_id: RequestId, future: TransferFuture | None, blocks: list[EngineBlockId],
                  sync: bool, answer_by: float = float("inf"),
                  retry: "Callable[[float], TransferFuture | None] | None" = None) -> None:
        """A load into ``blocks`` went out, its answer due by ``answer_by`` (``future`` None:
        it could not be sent, so its blocks are load errors at once)."""
        if future is None:
            self._load_errors.update(blocks)
            item = InFlight(None, [req_id], list(blocks), 0.0)
        else:
            item = InFlight(future, [req_id], list(blocks), time.monotonic(), answer_by, retry)
        if sync:
            self._sync_loads.append(item)
        else:
            self._loads[req_id] = item

    def wait_sync_pages(self, end: int, pages_per_block: int) -> None:
        """The forward is about to read every block's pages ``[0, end)``: wait until they
        landed for each layer-pipelined load of this step. One that did not (it failed, or
        nothing came by its answer time) is settled now: its blocks become load errors and
        the forward goes on over them (the engine recomputes them)."""
        still = []
        for item in self._sync_loads:
            call = item.future
            if isinstance(call, LayerwiseCall) and not call.wait_pages(end, pages_per_block, item.answer_by):
                self._sync_failed |= not self._settle_load(item, "layerwise")
                continue
            still.append(item)
        self._sync_loads = still

    def settle_sync_loads(self, forward_waited: bool = True) -> bool:
        """Wait for this step's synchronous loads (sent first, so they ran in parallel);
        returns whether any of them failed (or was never sent). ``forward_waited`` False: the
        forward did not wait for every page of the layer-pipelined ones, so they failed too."""
        items, self._sync_loads = self._sync_loads, []
        failed, self._sync_failed = self._sync_failed, False
        for item in items:
            layerwise = isinstance(item.future, LayerwiseCall)
            ok = self._settle_load(item, "layerwise" if layerwise else "sync")
            if ok and layerwise and not forward_waited:
                log.error("kvbm: the engine's forward did not wait for every layer of a layer-pipelined load of "
                          "%s (its layer hooks did not run: FULL CUDA graphs?); its %d blocks are recomputed",
                          item.req_ids[0], len(item.engine_blocks))
                self._load_errors.update(item.engine_blocks)
                ok = False
            failed |= not ok
        return failed

    def _settle_load(self, item: InFlight, mode: str) -> bool:
        """Whether the load succeeded."""
        if item.future is None:
            return False
        req_id = item.req_ids[0]
        answer = None
        try:
            answer = item.future.result()
        except Exception as exc:  # an RpcError, or cancelled with a replaced channel
            if item.unanswered(exc):
                self._on_unanswered(item)
            log.warning("kvbm load for %s failed (%s); the engine recomputes it", req_id, _why(exc))
            self._load_errors.update(item.engine_blocks)
            self._on_failure(exc)
        if isinstance(item.future, LayerwiseCall):
            item.future.end_signal()  # (after an unanswering daemon was stopped above)
        self._on_load_done(req_id, item, answer, mode)
        return answer is not None

    def take_load_errors(self) -> set[EngineBlockId]:
        """Engine blocks whose load failed since the last call (the engine recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ stores
    def store_sent(self, future: TransferFuture, blocks: list[EngineBlockId], req_ids: list[RequestId],
                   store_id: int = 0) -> None:
        """A store of ``blocks`` (owned by ``req_ids``) went out. Its call ends by the plan's
        deadline plus a margin: a store copy that reads the blocks after that is never served
        (the leader refuses a store reported after its deadline)."""
        self._stores.append(InFlight(future, list(req_ids), list(blocks), time.monotonic(), store_id=store_id))
        for req_id in req_ids:
            self._store_refs[req_id] = self._store_refs.get(req_id, 0) + 1

    def fence(self) -> None:
        """Wait for every store in flight: their blocks may be handed to other requests now."""
        stores, self._stores = self._stores, []
        for item in stores:
            self._settle_store(item)

    def _settle_store(self, item: InFlight) -> None:
        assert item.future is not None, "a store in flight was sent"
        try:
            item.future.result()
        except Exception as exc:  # a failed store costs a future hit, no more
            log.warning("kvbm store of %d blocks failed: %s", len(item.engine_blocks), _why(exc))
            self._on_failure(exc)
        if item.store_id:
            self._settled_stores.append(item.store_id)
        for req_id in item.req_ids:
            left = self._store_refs.get(req_id, 0) - 1
            if left > 0:
                self._store_refs[req_id] = left
            else:
                self._store_refs.pop(req_id, None)

    def store_dropped(self, store_ids: Iterable[int]) -> None:
        """Stores that were never sent (their blocks were not read): settled at once."""
        self._settled_stores.extend(i for i in store_ids if i)

    def take_settled_stores(self) -> list[int]:
        """The ids of the held stores settled (done, failed or dropped) since the last call, for
        the scheduler side's block holds (:mod:`.block_holds`)."""
        settled, self._settled_stores = self._settled_stores, []
        return settled

    @property
    def stores_in_flight(self) -> int:
        return len(self._stores)

    # ------------------------------------------------------------------ step end
    def finished(self, delayed_frees: Iterable[RequestId] = ()) -> tuple[set[RequestId], set[RequestId]]:
        """``(finished sending, finished loading)`` now; never waits.

        ``delayed_frees``: requests that ended with stores (the scheduler side kept their
        blocks); each is reported once none of its stores is in flight.
        """
        loaded: set[RequestId] = set()
        for req_id, item in list(self._loads.items()):
            if item.done:
                self._settle_load(item, "async")
                loaded.add(req_id)
                del self._loads[req_id]
        self._awaiting_send.update(delayed_frees)
        still = []
        for item in self._stores:
            if item.done:
                self._settle_store(item)
            else:
                still.append(item)
        self._stores = still
        sent = {r for r in self._awaiting_send if r not in self._store_refs}
        self._awaiting_send -= sent
        return sent, loaded


def _why(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    text = details() if callable(details) else None
    return text or repr(exc)
