"""Connector tracing for benchmarks: one JSON line per event to ``$KVBM_CONNECTOR_TRACE``.

Off unless the variable names a file (read once, at import). Both sides of a connector
(scheduler and worker processes) append to the same file; each line carries its pid.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

#: the trace file, or "" (tracing off)
TRACE_PATH = os.environ.get("KVBM_CONNECTOR_TRACE", "")


def tracing() -> bool:
    """Whether events are traced (callers skip computing their fields otherwise)."""
    return bool(TRACE_PATH)


def trace(what: str, **fields: Any) -> None:
    """Append one event (``what`` plus ``fields``) to the trace file."""
    with open(TRACE_PATH, "a") as f:
        f.write(json.dumps({"what": what, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")
