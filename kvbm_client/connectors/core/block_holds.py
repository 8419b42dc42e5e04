"""Engine blocks held while a store reads them, so that a finished request frees the rest at once.

Without holds, a finished request that has stores keeps *all* its blocks until the worker side
reports every store done (a delayed free, :meth:`.scheduler.SchedulerCore.finished`). On a
node whose engine memory is full, the next request then waits for the last chunk's copy and its
report: measured on an H100 (2026-11-27, 20K prompts, G1 4 GiB), the next cold request's first
step came 12 ms later than without stores, and a warm one's allocation ~4 ms later.

With an engine pool that can pin blocks (vLLM >= 0.26: ``bind_gpu_block_pool``, its blocks'
reference counts), the scheduler core instead pins each block of a store from the moment the
store is asked for (on the scheduler's thread, before the engine can free the block) until every
worker side reported the store settled (vLLM: ``kv_connector_worker_meta``). A finished request
is freed at once; only its blocks that a store still reads stay out of the pool, and the engine
keeps stepping while any is held (vLLM's ``has_pending_push_work``), so the reports arrive.

Invariants (the scheduler's thread only):

* each hold pins its blocks once and unpins each exactly once: when the leader planned no store
  for it (:meth:`BlockHolds.narrow`), when each of ``reporters`` worker sides reported it settled
  (:meth:`BlockHolds.settled`), when it expires, or on :meth:`BlockHolds.close`;
* a hold expires only after its plan's deadline plus :data:`EXPIRY_MARGIN_S`: by then no copy
  reads the block (a daemon starts no copy after the deadline and stops one at its next chunk,
  W1/W2 in :mod:`kvbm_client.connectors.core`), and a store reported later is never served (L1);
  a worker side that lost its daemon or never reports costs a block that long, no more;
* a hold asked for and not answered yet (a store plan still on the planner's thread) never
  expires: the answer narrows it, and :meth:`BlockHolds.close` releases it.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

from ...ids import EngineBlockId

log = logging.getLogger("kvbm.connector")

#: Seconds past a store plan's deadline that its blocks stay pinned without a report: the
#: worker side's own wait for the call (``worker.ANSWER_MARGIN_S``, 5 s) and some more.
EXPIRY_MARGIN_S = 10.0
#: The deadline assumed for a plan that carries none (an older leader): the worker side's wait.
NO_DEADLINE_S = 30.0


class BlockPins(Protocol):
    """The engine's block pool, as far as holds need it (called on the scheduler's thread)."""

    def pin(self, blocks: Sequence[EngineBlockId]) -> None:
        """Keep ``blocks`` out of the engine's free pool (one reference each)."""

    def unpin(self, blocks: Sequence[EngineBlockId]) -> None:
        """Drop the references :meth:`pin` took (a block with none left is free again)."""


@dataclass
class _Hold:
    blocks: list[EngineBlockId]
    reports_left: int
    expires: float  # CLOCK_MONOTONIC; inf while the store is asked for and not planned


class BlockHolds:
    """The held blocks of one scheduler core, by hold id (a store's ``store_id``).

    Args:
        pins: the engine's pool.
        reporters: worker sides that each report every store (vLLM: its world size).
    """

    def __init__(self, pins: BlockPins, reporters: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self._pins = pins
        self.reporters = max(1, reporters)
        self._clock = clock
        self._holds: dict[int, _Hold] = {}
        self._next = 0

    def hold(self, blocks: Sequence[EngineBlockId]) -> int:
        """Pin ``blocks`` for a store asked for now; returns the hold's id (> 0)."""
        self._next += 1
        self._pins.pin(blocks)
        self._holds[self._next] = _Hold(list(blocks), self.reporters, math.inf)
        return self._next

    def narrow(self, hold_id: int, planned: Sequence[EngineBlockId], deadline: float) -> bool:
        """The leader planned stores of ``planned`` (a sub-multiset of the held blocks; empty:
        none) with ``deadline`` (0: unknown): unpin the others. Returns whether the hold
        remains (then its store carries ``hold_id``)."""
        hold = self._holds.get(hold_id)
        if hold is None:
            return False
        left = Counter(planned)
        dropped = []
        for block in hold.blocks:
            if left[block] > 0:
                left[block] -= 1
            else:
                dropped.append(block)
        assert not +left, "planned blocks that the hold does not hold"
        if dropped:
            self._pins.unpin(dropped)
        if len(dropped) == len(hold.blocks):
            del self._holds[hold_id]
            return False
        hold.blocks = list(planned)
        hold.expires = (deadline if deadline > 0 else self._clock() + NO_DEADLINE_S) + EXPIRY_MARGIN_S
        return True

    def settled(self, hold_ids: Iterable[int]) -> None:
        """Worker sides reported these stores settled (done, failed or dropped), one id per
        report; the last report of a store unpins its blocks."""
        for hold_id in hold_ids:
            hold = self._holds.get(hold_id)
            if hold is None:
                log.debug("kvbm: a worker side reported store %d settled, which holds no block (expired?)", hold_id)
                continue
            hold.reports_left -= 1
            if hold.reports_left <= 0:
                del self._holds[hold_id]
                self._pins.unpin(hold.blocks)

    def expire(self) -> None:
        """Unpin the blocks of stores past their deadline plus the margin, unreported."""
        now = self._clock()
        for hold_id in [h for h, hold in self._holds.items() if hold.expires <= now]:
            hold = self._holds.pop(hold_id)
            log.warning("kvbm: store %d of %d blocks was not reported settled by %d of %d worker sides before its "
                        "deadline plus %gs; its blocks are freed (no copy reads them after the deadline)", hold_id,
                        len(hold.blocks), hold.reports_left, self.reporters, EXPIRY_MARGIN_S)
            self._pins.unpin(hold.blocks)

    @property
    def pending(self) -> bool:
        """Some block is held (the engine must keep stepping for the reports to arrive)."""
        return bool(self._holds)

    def close(self) -> None:
        """Unpin everything (the engine is going away)."""
        holds, self._holds = self._holds, {}
        for hold in holds.values():
            self._pins.unpin(hold.blocks)
