"""The stress harness's command line (``tests/stress/run.py``): pass names, and what makes a
kill-mid-load pass count (pure logic; the passes themselves run engines)."""
from __future__ import annotations

import pytest

from .faults import FaultKind
from .node import NodeConfig
from .run import fault_of, mid_load_error, parse_args, unstaged_error


def test_kill_mid_load_needs_layerwise_loads():
    with pytest.raises(SystemExit, match="--load-mode layerwise"):
        fault_of("kill-mid-load", parse_args(["--passes", "kill-mid-load"]))


def test_kill_mid_load_kills_inside_the_held_group():
    args = parse_args(["--load-mode", "layerwise", "--group-delay", "2", "--fault-delay-mid-load", "0.3",
                       "--down-secs", "1"])
    (fault,) = fault_of("kill-mid-load", args)
    assert fault.kind is FaultKind.KILL_MID_LOAD and fault.timed
    assert (fault.delay_s, fault.duration_s) == (0.3, 1.0)
    assert fault.worker_faults() == (("GROUP_DELAY_SECS", "2"),)
    with pytest.raises(SystemExit, match="longer than"):
        fault_of("kill-mid-load", parse_args(["--load-mode", "layerwise", "--group-delay", "0.1"]))


def test_a_kill_that_hit_no_load_proves_nothing():
    hit = {"fault_errors": [], "engine_log": {"loads_failed": 1}}
    assert mid_load_error(hit) is None
    assert "hit no load" in mid_load_error({"fault_errors": [], "engine_log": {"loads_failed": 0}})
    assert "did not strike" in mid_load_error({"fault_errors": ["engine ended before ['kill-mid-load'] struck"],
                                               "engine_log": {}})


def test_unknown_passes_are_refused():
    with pytest.raises(SystemExit, match="unknown pass"):
        fault_of("kill-everything", parse_args([]))


def test_a_staging_area_reaches_the_worker_and_must_be_used():
    args = parse_args(["--stage-mib", "512", "--no-nixl"])
    assert NodeConfig(stage_mib=args.stage_mib, no_nixl=args.no_nixl).worker_args() == \
        ["--no-nixl", "--stage-mib", "512"]
    assert NodeConfig().worker_args() == []
    assert "no load used a stage" in unstaged_error({"worker": {"loads_staged": 3, "staged_loads_used": 0}})
    assert unstaged_error({"worker": {"loads_staged": 3, "staged_loads_used": 2}}) is None
    assert unstaged_error({"worker": {"staged_loads_used": 0}, "restarts": {"worker": 1}}) is None
    assert unstaged_error({"worker": {"error": "gone"}}) is None
