"""``log_loop_stalls``: DYN_LOG=debug names a blocked event loop, and only then."""
from __future__ import annotations

import asyncio
import logging
import time

from kvbm_client.logs import log_loop_stalls


def run_with_watch(block_s: float, caplog, threshold_s: float) -> list[str]:
    log = logging.getLogger("kvbm.test.stalls")

    async def scenario() -> None:
        watch = asyncio.ensure_future(log_loop_stalls(log, threshold_s=threshold_s))
        await asyncio.sleep(0.03)  # the watch is running
        time.sleep(block_s)  # a blocking call on the loop
        await asyncio.sleep(0.03)  # the watch wakes up late and says so
        watch.cancel()

    with caplog.at_level(logging.DEBUG, logger="kvbm.test.stalls"):
        asyncio.run(scenario())
    return [r.getMessage() for r in caplog.records if r.name == "kvbm.test.stalls"]


def test_a_blocked_loop_is_logged_with_its_duration(caplog):
    messages = run_with_watch(0.3, caplog, threshold_s=0.1)
    assert len(messages) == 1, messages
    stalled_ms = float(messages[0].split("for ")[1].split(" ms")[0])
    assert 290 <= stalled_ms < 2000


def test_a_free_loop_logs_nothing(caplog):
    assert run_with_watch(0.0, caplog, threshold_s=0.1) == []  # only stalls past the threshold
