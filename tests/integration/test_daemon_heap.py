"""Both daemons freeze their start-up objects once they are up (``kvbm_client.heap``), so a
full garbage collection later walks only what they made since."""
from __future__ import annotations

import re
import time


def _frozen(log_path, who: str, timeout_s: float = 10.0) -> int:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = re.search(rf"{who}: (\d+) start-up objects frozen", log_path.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        time.sleep(0.1)
    raise AssertionError(f"{who} did not freeze its start-up objects")


def test_leader_and_worker_freeze_their_startup_heap(make_node):
    node = make_node()
    logs = sorted(p.name for p in node.root.glob("*.log"))
    worker_log = next(node.root / name for name in logs if name.startswith("worker"))
    assert _frozen(node.root / "leader.log", "leader") > 10_000  # modules, gRPC, protobuf: tens of thousands
    assert _frozen(worker_log, "worker") > 10_000
