"""Loads before stores on one worker's host link: a store's next piece waits while a load runs.

Runs in the worker daemon, for :class:`~.mover.BlockMover`: the load lane marks each load from G2
into the engine (:meth:`LoadsFirst.loading`; a G3 load runs at disk speed and is not marked), the
store lane asks before each piece of a store from the engine to G2 (:meth:`StoreTurn.before_piece`).
One object per mover, shared by its two lane threads.

Why (2026-11-27, twenty-first session, ``benchmarks/daemon_layer_loads.py --layout per-layer
--stores-beside``): a 20K load (2.97 GB from G2) took 59 ms alone and 71-79 ms while a 20K store
ran on the same worker (H200), because the two DMAs share the host link. A warm request's first
token waits for its load; nobody waits for a store (the engine's blocks it reads are held until it
lands). With this gate, on an H100: 65.3 ms beside a store (95.7 without it; 62.6 alone), the store
47 ms longer.

Invariants:

* a load never waits for a store;
* a store waits only between its pieces (what it already queued keeps copying), at most
  ``budget_s`` in all per job, and never so long that its next piece, at the slowest rate a DMA
  is assumed to run (``DMA_FLOOR_BPS``), would land after the job's deadline;
* ``budget_s`` 0 turns waiting off.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .grouping import DMA_FLOOR_BPS

log = logging.getLogger("kvbm.worker")
STORE_YIELD_MS = 200.0  # default: at most this long a store job waits for loads, in all
MAX_STORE_YIELD_MS = 10_000.0


@dataclass
class LoadsFirst:
    """Counts the loads running; lets a store wait for none to be."""

    budget_s: float = STORE_YIELD_MS / 1e3
    clock: Callable[[], float] = time.monotonic
    _active: int = field(default=0, init=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.budget_s <= MAX_STORE_YIELD_MS / 1e3:
            raise ValueError(f"a store's wait for loads must be in [0, {MAX_STORE_YIELD_MS / 1e3}] s, "
                             f"not {self.budget_s}")

    @contextlib.contextmanager
    def loading(self, on: bool = True) -> Iterator[None]:
        """A load runs in this block (``on`` False: nothing is marked)."""
        if not on:
            yield
            return
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    @property
    def active(self) -> int:
        return self._active

    def store(self) -> StoreTurn:
        """One store job's waits, with a fresh budget."""
        return StoreTurn(self, self.budget_s)


@dataclass
class StoreTurn:
    """One store job: how long it may still wait, and has waited."""

    gate: LoadsFirst
    left_s: float
    waited_s: float = 0.0
    waits: int = 0

    def before_piece(self, until: float, nbytes: int) -> float:
        """Wait while a load runs, while budget is left and a piece of ``nbytes`` would still land
        by ``until`` (the gate's clock); returns the seconds waited."""
        gate = self.gate
        with gate._cond:
            if not gate._active or self.left_s <= 0:
                return 0.0
            start = gate.clock()
            timeout = min(self.left_s, until - nbytes / DMA_FLOOR_BPS - start)
            if timeout <= 0:
                return 0.0
            gate._cond.wait_for(lambda: not gate._active, timeout)
            waited = max(0.0, gate.clock() - start)
        self.left_s -= waited
        self.waited_s += waited
        self.waits += 1
        return waited

    def log(self, blocks: int) -> None:
        if self.waits:
            log.debug("store of %d blocks waited %.1f ms for loads (%d times)", blocks, self.waited_s * 1e3,
                      self.waits)
