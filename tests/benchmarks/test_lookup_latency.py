"""benchmarks/lookup_latency.py against a real node (leader + CPU worker as child processes, gRPC
over unix sockets), tiny sizes: every operation returns one timed sample per rep, the store
operation's every request is planned whole (its own assertion: a pool too small for the slots
that released stores keep until their jobs expire fails it), and a miss never matches (its own
assertion), asked or answered by the presence filter."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import lookup_latency  # noqa: E402


@pytest.mark.parametrize("op", ["load", "store", "miss", "miss_filter"])
def test_one_pass_times_every_rep(op: str) -> None:
    samples = lookup_latency.one_pass(REPO, blocks=16, reps=5, op=op)
    assert len(samples) == 5
    assert all(0 < ms < 5000 for ms in samples)


def test_the_filter_answers_fresh_keys_as_misses_in_the_client() -> None:
    false_maybe: list[int] = []
    lookup_latency.one_pass(REPO, blocks=16, reps=20, op="miss_filter", false_maybe=false_maybe)
    assert false_maybe == [0], "30 fresh keys against 32 of 2^24 slots: no false 'maybe'"


def test_a_variant_is_a_label_and_daemon_settings() -> None:
    assert lookup_latency.parse_variant("off:DYN_KVBM_PRESENCE_FILTER_SLOTS=0,DYN_LOG=debug") == (
        "off", {"DYN_KVBM_PRESENCE_FILTER_SLOTS": "0", "DYN_LOG": "debug"})
    assert lookup_latency.parse_variant("on") == ("on", {})
    assert lookup_latency.label(REPO, "store", "off") == f"{REPO} [off]"


def test_a_gap_leaves_the_node_idle_between_lookups() -> None:
    import time
    start = time.monotonic()
    samples = lookup_latency.one_pass(REPO, blocks=16, reps=3, op="load", gap_s=0.2)
    assert len(samples) == 3
    assert time.monotonic() - start >= 13 * 0.2, "the gap follows each of the 13 lookups (10 warm-up)"
