"""Logging set-up shared by every kvbm process: ``DYN_LOG`` picks the level (as in Dynamo).

``DYN_LOG=debug`` shows every offload/onboard decision, one line each.
"""
from __future__ import annotations

import logging
import os
import sys

_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "warning": logging.WARNING, "error": logging.ERROR}


def dyn_log_level(level: str | None = None) -> int:
    """``level`` or ``DYN_LOG`` (default info) as a logging level. ``DYN_LOG`` may carry
    per-target filters ("info,kvbm=debug"): the kvbm one counts, else the first."""
    name = (level or os.environ.get("DYN_LOG") or "info").strip().lower()
    parts = [p for p in name.split(",") if p]
    chosen = next((p.split("=", 1)[1] for p in parts if p.startswith("kvbm=")), parts[0] if parts else "info")
    return _LEVELS.get(chosen, logging.INFO)


def setup_logging(process: str, level: str | None = None) -> None:
    logging.basicConfig(
        level=dyn_log_level(level), stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {process}[%(process)d] %(name)s: %(message)s", force=True)
    # gRPC's own debug chatter (one line per poll) would drown the decisions.
    logging.getLogger("grpc").setLevel(max(logging.WARNING, logging.getLogger().level))


async def log_loop_stalls(log: logging.Logger, threshold_s: float = 0.02, period_s: float = 0.005) -> None:
    """Until cancelled: log (debug) each time this event loop could not run for ``threshold_s``
    or more (a blocking call on the loop, the GIL held by a thread), with how long."""
    import asyncio
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(period_s)
        late = loop.time() - start - period_s
        if late >= threshold_s:
            log.debug("event loop stalled for %.1f ms", late * 1e3)


def attach_engine_logging(level: str | None = None) -> None:
    """In an engine's process (vLLM, TensorRT-LLM), make the connector's lines visible.

    The engines configure their own loggers only (vLLM: ``vllm``, with ``propagate`` off), so a
    ``kvbm.*`` line reaches a root logger with no handler, where Python prints WARNING and above
    bare (no time, no source) and drops the rest: an operator would not see which load mode the
    connector chose or that it connected. This adds one stderr handler to the ``kvbm`` logger at
    ``DYN_LOG``'s level (default info), in the engines' style, unless the root logger or ``kvbm``
    has a handler already (an engine or a test that configured logging). Idempotent.
    """
    kvbm = logging.getLogger("kvbm")
    if kvbm.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvbm %(name)s] %(message)s", "%m-%d %H:%M:%S"))
    kvbm.addHandler(handler)
    kvbm.setLevel(dyn_log_level(level))
    kvbm.disabled = False
