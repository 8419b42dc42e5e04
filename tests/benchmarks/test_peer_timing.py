"""The peer-timing wrapper (benchmarks/peer_timing.py) around a stand-in connector: each hook's
result and arguments pass through, and the trace gets one line per hook with its duration (the
forward's only for a step that started loads)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peer_timing  # noqa: E402
import vllm_peers  # noqa: E402


class StandIn:
    """A stand-in for a vLLM connector (LMCache is not installed here)."""

    def __init__(self):
        self.calls = []

    def get_num_new_matched_tokens(self, request, computed):
        self.calls.append(("lookup", request, computed))
        return 96, False

    def build_connector_meta(self, out):
        return {"meta": out}

    def start_load_kv(self, ctx, **kw):
        time.sleep(0.01)  # the synchronous load
        self.calls.append(("load", ctx, kw))

    def wait_for_save(self):
        self.calls.append(("save",))


@pytest.fixture
def traced(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    from kvbm_client.connectors.core import tracing
    monkeypatch.setattr(tracing, "TRACE_PATH", str(path))
    return path


def test_hooks_pass_through_and_are_timed(traced):
    conn = peer_timing.timed(StandIn)()
    assert type(conn).__name__ == "TimedStandIn"
    assert conn.get_num_new_matched_tokens("r1", 16) == (96, False)
    assert conn.build_connector_meta("out") == {"meta": "out"}
    conn.wait_for_save()  # a step before any load: no forward line
    conn.start_load_kv("ctx", extra=1)
    time.sleep(0.005)  # the forward
    conn.wait_for_save()
    assert conn.calls == [("lookup", "r1", 16), ("save",), ("load", "ctx", {"extra": 1}), ("save",)]
    events = [json.loads(line) for line in traced.read_text().splitlines()]
    assert [e["what"] for e in events] == ["peer_lookup", "peer_meta", "peer_save", "peer_load", "peer_forward",
                                           "peer_save"]
    load, forward = events[3], events[4]
    assert load["ms"] >= 10 and 0 <= load["cpu_ms"] < load["ms"]  # it slept: wall, not CPU
    assert forward["ms"] >= 5


def test_the_class_vllm_asks_for_needs_vllm_and_unknown_names_fail():
    with pytest.raises(AttributeError):
        peer_timing.NoSuchConnector  # noqa: B018
    with pytest.raises(ImportError):  # (vLLM is not installed in the test environment)
        peer_timing.TimedLMCacheConnectorV1  # noqa: B018


def test_the_harness_runs_lmcache_timed_through_this_module():
    kw, env = vllm_peers.system_kwargs("lmcache_timed", 24)
    assert kw["kv_transfer_config"] == {"kv_connector": "TimedLMCacheConnectorV1", "kv_role": "kv_both",
                                        "kv_connector_module_path": "benchmarks.peer_timing"}
    assert env == vllm_peers.system_kwargs("lmcache", 24)[1]


def test_the_breakdown_splits_a_timed_peer_request():
    import ttft_breakdown
    t0 = 1000.0
    rows = [{"round": 0, "t0": t0 - 5, "ttft_s": 1.0},
            {"round": 1, "t0": t0, "ttft_s": 0.080}]
    ev = lambda what, t, **kw: {"what": what, "pid": 7, "t": t0 + t / 1e3, **kw}  # noqa: E731
    events = [ev("peer_lookup", 8.0, ms=1.0), ev("peer_meta", 9.0, ms=0.2), ev("peer_load", 70.0, ms=55.0, cpu_ms=3.0),
              ev("peer_save", 70.5, ms=0.1), ev("peer_forward", 75.0, ms=5.0, cpu_ms=4.0), ev("peer_load", 76.0, ms=0.1,
                                                                                           cpu_ms=0.1)]
    (row,) = ttft_breakdown.peer_breakdown(rows, events)
    assert row["front"] == pytest.approx(7.0) and row["lookup"] == pytest.approx(1.0)
    assert row["to_load"] == pytest.approx(7.0)  # lookup ended at 8, the 55 ms load began at 15
    assert (row["load"], row["load_cpu"], row["forward"], row["forward_cpu"]) == (55.0, 3.0, 5.0, 4.0)
    assert row["after"] == pytest.approx(5.0) and row["ttft"] == pytest.approx(80.0)
