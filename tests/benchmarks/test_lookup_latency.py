"""benchmarks/lookup_latency.py against a real node (leader + CPU worker as child processes, gRPC
over unix sockets), tiny sizes: both operations return one timed round trip per rep, and the
store operation's every request is planned whole (its own assertion: a pool too small for the
slots that released stores keep until their jobs expire fails it)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import lookup_latency  # noqa: E402


@pytest.mark.parametrize("op", ["load", "store"])
def test_one_pass_times_every_rep(op: str) -> None:
    samples = lookup_latency.one_pass(REPO, blocks=16, reps=5, op=op)
    assert len(samples) == 5
    assert all(0 < ms < 5000 for ms in samples)
