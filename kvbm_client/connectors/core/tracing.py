"""Connector tracing for benchmarks: one JSON line per event to ``$KVBM_CONNECTOR_TRACE``.

Off unless the variable names a file (read once, at import). Both sides of a connector
(scheduler and worker processes) append to the same file; each line carries its pid.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from ... import heap

#: the trace file, or "" (tracing off)
TRACE_PATH = os.environ.get("KVBM_CONNECTOR_TRACE", "")


def tracing() -> bool:
    """Whether events are traced (callers skip computing their fields otherwise)."""
    return bool(TRACE_PATH)


def trace(what: str, **fields: Any) -> None:
    """Append one event (``what`` plus ``fields``) to the trace file."""
    with open(TRACE_PATH, "a") as f:
        f.write(json.dumps({"what": what, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")


def trace_collections() -> None:
    """While tracing, trace each long garbage collection of this (the engine's) process as a
    ``gc`` event (generation, ms, freed): a collection holds the process's interpreter lock, so a
    request's slow lookup or forward can be matched with one. Once per process; nothing when
    tracing is off. Its first install traces a ``gc_watch`` event (the threshold), so a reader
    tells "no long collection" from "not watched"."""
    if tracing():
        watch = heap.CollectionWatch("trace", lambda generation, ms, freed: trace("gc", generation=generation,
                                                                                    ms=round(ms, 2), freed=freed),
                                     heap.SLOW_COLLECTION_MS)
        if watch.install() is watch:
            trace("gc_watch", min_ms=watch.min_ms)
