"""benchmarks/rpc_floor.py: each way's server (a child process on a unix socket) answers a
lookup-sized request with a plan-sized answer (the client checks the size), once per rep."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import rpc_floor  # noqa: E402


@pytest.mark.parametrize("kind", rpc_floor.KINDS)
def test_every_way_times_every_rep(kind: str) -> None:
    samples = rpc_floor.one_pass(kind, reps=4, gap_s=0.01)
    assert len(samples) == 4
    assert all(0 < ms < 5000 for ms in samples)
