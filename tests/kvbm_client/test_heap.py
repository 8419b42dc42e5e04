"""``kvbm_client.heap``: the start-up objects leave the collector's walk; later garbage is
still collected."""
from __future__ import annotations

import gc
import json
import os
import weakref

from kvbm_client import heap
from kvbm_client.heap import CollectionWatch, freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: "Node | None" = None


def test_frozen_startup_objects_leave_the_walk_and_later_cycles_are_still_collected():
    startup = [[i] for i in range(200_000)]  # long-lived, tracked: what a started daemon holds
    try:
        frozen = freeze_startup_heap("test")
        # Frozen objects still die when their last reference goes (a temporary the caller held
        # during the call, say), and leave the permanent generation then: the count may only fall.
        assert frozen >= len(startup) and len(startup) <= gc.get_freeze_count() <= frozen
        assert not any(o is startup for o in gc.get_objects()), "a frozen object is still walked"
        assert not any(o is startup[0] for o in gc.get_objects())
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None, "a cycle made after the freeze is still collected"
    finally:
        gc.unfreeze()


def test_a_collection_watch_reports_each_long_collection_once_per_name():
    seen: list[tuple[int, float, int]] = []
    watch = CollectionWatch("test", lambda g, ms, freed: seen.append((g, ms, freed)), min_ms=0.0)
    try:
        assert watch.install() is watch
        again = CollectionWatch("test", lambda g, ms, freed: seen.append((-9, ms, freed)), min_ms=0.0)
        assert again.install() is watch, "a second watch of one name must not report the same collections again"
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        gc.collect()
        full = [s for s in seen if s[0] == 2]
        assert full and full[-1][2] >= 2 and full[-1][1] >= 0.0, seen
        assert all(g != -9 for g, _, _ in seen)
        assert watch.reported == len(seen) and watch.seen >= watch.reported
    finally:
        watch.remove()
    count = len(seen)
    gc.collect()
    assert len(seen) == count, "a removed watch still reported"


def test_a_collection_watch_reports_nothing_under_its_threshold():
    seen: list[int] = []
    watch = CollectionWatch("quiet", lambda g, ms, freed: seen.append(g), min_ms=60_000.0).install()
    try:
        gc.collect()
        assert watch.seen >= 1 and not seen
    finally:
        watch.remove()


def test_the_connector_traces_long_collections_of_its_process(tmp_path, monkeypatch):
    from kvbm_client.connectors.core import tracing
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(tracing, "TRACE_PATH", str(path))
    monkeypatch.setattr(heap, "SLOW_COLLECTION_MS", 0.0)
    before = list(gc.callbacks)
    try:
        tracing.trace_collections()
        tracing.trace_collections()  # once per process
        assert len(gc.callbacks) == len(before) + 1
        gc.collect()
        events = [json.loads(line) for line in path.read_text().splitlines()]
        assert [e["min_ms"] for e in events if e["what"] == "gc_watch"] == [0.0]
        full = [e for e in events if e["what"] == "gc" and e["generation"] == 2]
        assert len(full) == 1 and full[0]["ms"] >= 0 and full[0]["pid"] == os.getpid(), events
    finally:
        gc.callbacks[:] = before


def test_a_daemon_logs_its_long_collections_at_debug_level(caplog, monkeypatch):
    before = list(gc.callbacks)
    try:
        watch = heap.log_slow_collections("worker", min_ms=0.0)
        assert heap.log_slow_collections("worker", min_ms=0.0) is watch  # once per process and name
        with caplog.at_level("DEBUG", logger="kvbm"):
            gc.collect()
        lines = [r.getMessage() for r in caplog.records if "garbage collection (generation 2)" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("worker: ") and " ms, every Python thread waiting" in lines[0], lines
    finally:
        gc.callbacks[:] = before
