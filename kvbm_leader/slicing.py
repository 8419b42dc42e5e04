"""Bounded work per request: drive a stepper (:mod:`.steps`) in slices, yielding to the event
loop between slices so no request holds the leader for long.

Runs in the leader, on its event loop. A slice ends after :data:`SLICE_SECONDS` (checked every
:data:`STEP_ITEMS` items); a request of a few hundred keys never yields at all. After a yield
the placement may have been reset (a worker was lost, the pools re-planned): the stepper's
state then belongs to the old registry, and the caller must drop it.
"""
from __future__ import annotations

import asyncio
import time

from .placement import PlacementPolicy
from .steps import Stepper

#: Longest time one request holds the loop before it lets others in (a KeepAlive arriving
#: meanwhile waits for at most about one slice).
SLICE_SECONDS = 0.005
#: Items between two clock reads (a few hundred microseconds of work).
STEP_ITEMS = 128
#: How long a slice gives way. NOTE: not 0: a call that arrived meanwhile needs several turns
#: of the loop (read, handler, write); a zero sleep gives it one turn per slice, so a KeepAlive
#: took many slices. A short real sleep lets the loop run everything that is ready.
YIELD_SECONDS = 0.001


async def run_sliced(stepper: Stepper, placement: PlacementPolicy) -> bool:
    """Run ``stepper`` to its end; False if ``placement`` was reset meanwhile (the stepper
    stopped at a slice boundary, its work so far belongs to the old registry)."""
    generation = placement.generation
    started = time.perf_counter()
    while not stepper.step(STEP_ITEMS):
        if time.perf_counter() - started >= SLICE_SECONDS:
            await asyncio.sleep(YIELD_SECONDS)
            if placement.generation != generation:
                return False
            started = time.perf_counter()
    return placement.generation == generation
