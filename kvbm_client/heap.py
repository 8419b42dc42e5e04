"""The daemons' heap and Python's cyclic garbage collector.

A full (generation-2) collection walks every object the collector tracks, on the thread that
allocated the object that triggered it: in a daemon, the event loop's thread, inside whatever
request is in flight. A started daemon holds tens of thousands of objects that live as long as
it does (modules, gRPC's and protobuf's machinery, its own wiring); :func:`freeze_startup_heap`
moves them to the collector's permanent generation once the daemon is up, so later collections
walk only what was made after it (``benchmarks/gc_pause.py``: a 65536-block leader registry's
full collection 3.3 ms with the start-up objects frozen, 23.5 ms without, 2-core VM).

Frozen objects are never collected: cyclic garbage made before the call stays (start-up makes
little). Objects made later are collected as before.

:class:`CollectionWatch` says when a collection was long: a collection holds its thread, and with
it the interpreter lock, so every Python thread of the process stops for it (the worker daemon's copy
lane, the engine's thread that runs kvbm's connector). The daemons log each collection of at least
``min_ms`` at debug level; the connector also traces it (``KVBM_CONNECTOR_TRACE``), so a slow
request in a benchmark can be matched with the pauses of its processes.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("kvbm")


def freeze_startup_heap(who: str) -> int:
    """Collect once, then freeze every object alive now (``gc.freeze``); returns how many the
    permanent generation holds. Call once, when the daemon has started."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of the garbage collector's way", who, frozen)
    return frozen


#: collections shorter than this are not reported (a young generation's takes microseconds)
SLOW_COLLECTION_MS = 2.0


class CollectionWatch:
    """Times every collection of the cyclic collector (``gc.callbacks``) and calls
    ``report(generation, ms, collected)`` for each that took at least ``min_ms``, on the thread
    that collected, after the collection. :meth:`install` adds it to the process's callbacks
    unless a watch of the same ``name`` is there already (then it returns that one: one report
    per collection whoever installs it); :meth:`remove` takes it away. ``report`` must not raise
    and must be quick."""

    def __init__(self, name: str, report: Callable[[int, float, int], None],
                 min_ms: float = SLOW_COLLECTION_MS) -> None:
        self.name = name
        self.report = report
        self.min_ms = min_ms
        self._started: dict[int, float] = {}  # thread id -> perf_counter at the collection's start
        #: collections seen, and how many were reported
        self.seen = 0
        self.reported = 0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = time.perf_counter()
            return
        started = self._started.pop(ident, None)
        if started is None:
            return  # installed during a collection
        self.seen += 1
        ms = (time.perf_counter() - started) * 1e3
        if ms >= self.min_ms:
            self.reported += 1
            self.report(int(info.get("generation", -1)), ms, int(info.get("collected", 0)))

    def install(self) -> "CollectionWatch":
        for callback in gc.callbacks:
            other = getattr(callback, "__self__", None)
            if isinstance(other, CollectionWatch) and other.name == self.name:
                return other
        gc.callbacks.append(self._callback)
        return self

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def log_slow_collections(who: str, min_ms: float = SLOW_COLLECTION_MS) -> CollectionWatch:
    """Install a :class:`CollectionWatch` that logs each collection of ``min_ms`` or more at debug
    level (``DYN_LOG=debug``) as ``<who>: garbage collection (generation G) took N ms, every Python
    thread waiting``."""
    def report(generation: int, ms: float, collected: int) -> None:
        log.debug("%s: garbage collection (generation %d) took %.1f ms, every Python thread waiting; "
                  "%d objects freed", who, generation, ms, collected)
    return CollectionWatch(f"log {who}", report, min_ms).install()
