"""The pass logic of the vLLM peers harness (benchmarks/peer_passes.py): the order the systems run
in, the medians over the passes and the "did not reproduce" flag. Pure logic: no engine, no GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peer_passes import run_passes, schedule, slots, summarize, summary_line  # noqa: E402


def run(system: str, p50: float, p90: float, pass_index: int, slot: str | None = None) -> dict:
    """A result line as an engine process writes it (only the fields the summary reads)."""
    return {"system": system, "slot": slot or system, "pass": pass_index, "warm_ttft_p50": p50,
            "warm_ttft_p90": p90, "warm_cached_frac": 0.99, "rows": [], "mode": "eager"}


def by_slot(results: list[dict]) -> dict[str, dict]:
    return {s["summary"]: s for s in summarize(results)}


def test_slots_label_a_repeated_system_by_its_occurrence():
    assert slots(["baseline", "ours", "ours", "native", "ours"]) == ["baseline", "ours", "ours#2", "native", "ours#3"]


def test_schedule_alternates_the_systems_pass_by_pass_in_order_then_in_reverse():
    order = schedule(["baseline", "native", "ours"], 3)
    assert [(p, name) for p, _, name in order] == [
        (0, "baseline"), (0, "native"), (0, "ours"),
        (1, "ours"), (1, "native"), (1, "baseline"),
        (2, "baseline"), (2, "native"), (2, "ours")]


def test_schedule_of_one_pass_is_the_systems_once():
    assert schedule(["baseline", "ours", "ours"], 1) == [(0, "baseline", "baseline"), (0, "ours", "ours"),
                                                         (0, "ours#2", "ours")]


@pytest.mark.parametrize("passes", [0, -1])
def test_schedule_refuses_fewer_than_one_pass(passes):
    with pytest.raises(ValueError):
        schedule(["baseline"], passes)


def test_run_passes_calls_the_runner_in_order_and_emits_each_result_as_it_comes():
    calls, emitted = [], []

    def fake_runner(system: str, pass_index: int) -> dict:
        calls.append((system, pass_index))
        assert len(emitted) == len(calls) - 1  # the previous result was emitted before this run
        return {"system": system, "warm_ttft_p50": 0.1, "warm_ttft_p90": 0.2, "rows": []}

    results = run_passes(["a", "b", "a"], 2, fake_runner, emitted.append)
    assert calls == [("a", 0), ("b", 0), ("a", 0), ("a", 1), ("b", 1), ("a", 1)]
    assert [(r["pass"], r["slot"]) for r in results] == [(0, "a"), (0, "b"), (0, "a#2"), (1, "a#2"), (1, "b"),
                                                        (1, "a")]
    assert emitted == results


def test_medians_and_each_pass_value_per_system():
    s = by_slot([run("ours", 0.100, 0.120, 0), run("ours", 0.106, 0.128, 1), run("ours", 0.101, 0.121, 2)])["ours"]
    assert s["warm_ttft_p50_median"] == pytest.approx(0.101)  # the median, not the mean (0.1023)
    assert s["warm_ttft_p90_median"] == pytest.approx(0.121)
    assert s["warm_ttft_p50_passes"] == [0.100, 0.106, 0.101]  # in pass order
    assert s["warm_ttft_p90_passes"] == [0.120, 0.128, 0.121]
    assert s["passes"] == [0, 1, 2]
    assert s["reproduced"] is True and s["why_not"] == []
    assert s["mode"] == "eager"


def test_passes_within_ten_percent_reproduce_and_beyond_do_not():
    results = [run("lmcache", 0.100, 0.140, 0), run("lmcache", 0.109, 0.145, 1),  # 9 %: reproduced
               run("native", 0.100, 0.140, 0), run("native", 0.111, 0.145, 1)]  # 11 %: did not
    s = by_slot(results)
    assert s["lmcache"]["reproduced"] is True
    assert s["native"]["reproduced"] is False
    assert s["native"]["warm_ttft_p50_spread"] == pytest.approx(0.11)
    assert s["native"]["why_not"] == ["p50 passes differ by 11.0 % > 10 %"]


def test_p90_alone_differing_is_a_failure_to_reproduce():
    s = by_slot([run("dynamo", 0.100, 0.130, 0), run("dynamo", 0.101, 0.170, 1)])["dynamo"]
    assert s["reproduced"] is False
    assert s["why_not"] == ["p90 passes differ by 30.8 % > 10 %"]


def test_a_failed_pass_is_not_a_reproduction_and_the_median_is_over_the_passes_that_ran():
    failed = {"system": "ours", "slot": "ours", "pass": 1, "error": "timeout after 300s"}
    s = by_slot([run("ours", 0.100, 0.120, 0), failed, run("ours", 0.102, 0.124, 2)])["ours"]
    assert s["failed_passes"] == [1]
    assert s["warm_ttft_p50_passes"] == [0.100, None, 0.102]
    assert s["warm_ttft_p50_median"] == pytest.approx(0.101)
    assert s["reproduced"] is False and "pass 1 failed" in s["why_not"]


def test_one_pass_cannot_say_whether_it_reproduced():
    s = by_slot([run("ours", 0.100, 0.120, 0)])["ours"]
    assert s["reproduced"] is None
    assert s["warm_ttft_p50_spread"] is None
    assert "one pass" in summary_line(s)


def test_repeated_systems_are_summarized_apart():
    results = [run("ours", 0.100, 0.12, 0, "ours"), run("ours", 0.300, 0.32, 0, "ours#2"),
               run("ours", 0.101, 0.12, 1, "ours"), run("ours", 0.301, 0.32, 1, "ours#2")]
    s = by_slot(results)
    assert list(s) == ["ours", "ours#2"]
    assert s["ours"]["warm_ttft_p50_median"] == pytest.approx(0.1005)
    assert s["ours#2"]["warm_ttft_p50_median"] == pytest.approx(0.3005)
    assert s["ours#2"]["system"] == "ours"


def test_summary_line_flags_a_system_that_did_not_reproduce():
    s = by_slot([run("native", 0.100, 0.140, 0), run("native", 0.130, 0.141, 1)])["native"]
    line = summary_line(s)
    assert "DID NOT REPRODUCE" in line and "p50 passes differ by 30.0 %" in line
    assert "100.0/140.0 130.0/141.0" in line  # each pass's p50/p90, ms
    ok = by_slot([run("native", 0.100, 0.140, 0), run("native", 0.101, 0.141, 1)])["native"]
    assert "DID NOT" not in summary_line(ok) and "reproduced" in summary_line(ok)


def test_quantile_is_the_value_at_int_p_n_of_the_sorted_values():
    from peer_passes import quantile
    assert quantile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert quantile([5.0, 1.0, 3.0, 2.0, 4.0], 0.9) == 5.0 and quantile([2.0], 0.9) == 2.0
    assert quantile(list(map(float, range(10))), 0.9) == 9.0
