"""Logging set-up shared by every kvbm process: ``DYN_LOG`` picks the level (as in Dynamo).

``DYN_LOG=debug`` shows every offload/onboard decision, one line each.
"""
from __future__ import annotations

import logging
import os
import sys

_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "warning": logging.WARNING, "error": logging.ERROR}


def setup_logging(process: str, level: str | None = None) -> None:
    name = (level or os.environ.get("DYN_LOG") or "info").strip().lower()
    # DYN_LOG may carry per-target filters ("info,kvbm=debug"): take the kvbm one, else the first.
    parts = [p for p in name.split(",") if p]
    chosen = next((p.split("=", 1)[1] for p in parts if p.startswith("kvbm=")), parts[0] if parts else "info")
    logging.basicConfig(
        level=_LEVELS.get(chosen, logging.INFO), stream=sys.stderr,
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
