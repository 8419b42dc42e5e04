"""benchmarks/ttft_breakdown.py reads the harness's files with passes (and the files from before
them): the table's medians over the passes, the trace's process of each run found by time, the
breakdown pooled over the passes or of one pass (``--pass``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import ttft_breakdown  # noqa: E402


def engine_run(system: str, pass_index: int | None, start: float, ttft: float) -> dict:
    """A result line of one engine: 2 users x 2 rounds, every request ``ttft`` long, 1 s apart."""
    rows = [{"round": r, "user": u, "tokens": 1000, "ttft_s": ttft, "t0": start + 2 * r + u, "cached": 990 * (r > 0),
             "output": [7]} for r in range(2) for u in range(2)]
    line = {"system": system, "warm_ttft_p50": ttft, "warm_ttft_p90": ttft, "warm_cached_frac": 0.99, "rows": rows}
    if pass_index is not None:
        line["pass"] = pass_index
    return line


def trace_of(run: dict, pid: int, wait_ms: float) -> list[dict]:
    """The connector's events of one engine: per warm request a lookup, a load that waited
    ``wait_ms``, the finish."""
    events = []
    for r in run["rows"]:
        if r["round"] == 0:
            continue
        t0, t1 = r["t0"], r["t0"] + r["ttft_s"]
        events += [{"what": "prepare_load", "pid": pid, "t": t0 + 0.004, "req": f"{t0}", "ms": 1.0},
                   {"what": "load", "pid": pid, "t": t0 + 0.010 + wait_ms / 1e3, "req": f"{t0}",
                    "submit_to_done_ms": wait_ms, "blocks": 10, "copy_ms": wait_ms},
                   {"what": "finished", "pid": pid, "t": t1 - 0.001, "req": f"{t0}"}]
    return events


@pytest.fixture
def two_passes(tmp_path):
    """baseline, ours per pass; ours's load waits 20 ms in pass 0 and 40 ms in pass 1. The trace's
    processes are written out of order (pass 1's first): only time can tell them apart."""
    runs = [engine_run("baseline", 0, 100.0, 0.300), engine_run("ours", 0, 200.0, 0.100),
            engine_run("baseline", 1, 300.0, 0.310), engine_run("ours", 1, 400.0, 0.130)]
    summary = {"summary": "ours", "system": "ours", "passes": [0, 1]}  # the harness's summary line: skipped
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(x) + "\n" for x in [{"provenance": {}}, *runs, summary]))
    trace = tmp_path / "t.jsonl"
    events = trace_of(runs[3], 222, 40.0) + trace_of(runs[1], 111, 20.0)
    trace.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(results), str(trace)


def breakdown_main(monkeypatch, capsys, *argv: str) -> str:
    monkeypatch.setattr(sys, "argv", ["ttft_breakdown.py", *argv])
    ttft_breakdown.main()
    return capsys.readouterr().out


def test_runs_carry_their_pass_and_slot(two_passes, tmp_path):
    runs = ttft_breakdown.load_runs(two_passes[0])
    assert [(r["system"], r["pass"], r["slot"]) for r in runs] == [
        ("baseline", 0, "baseline"), ("ours", 0, "ours"), ("baseline", 1, "baseline"), ("ours", 1, "ours")]
    assert [r["pass"] for r in ttft_breakdown.load_runs(two_passes[0], 1)] == [1, 1]
    old = tmp_path / "old.jsonl"  # before passes: no pass, no slot, a system listed twice
    old.write_text("".join(json.dumps(engine_run(s, None, 100.0 * i, 0.1)) + "\n"
                           for i, s in enumerate(["baseline", "ours", "ours"])))
    assert [(r["pass"], r["slot"]) for r in ttft_breakdown.load_runs(str(old))] == [
        (0, "baseline"), (0, "ours"), (0, "ours#2")]


def test_the_trace_process_of_a_run_is_found_by_time(two_passes):
    runs = ttft_breakdown.load_runs(two_passes[0])
    events = [json.loads(line) for line in open(two_passes[1])]
    assert [ttft_breakdown.trace_pid(r, events) for r in runs] == [None, 111, None, 222]


def test_every_pass_by_default(two_passes, monkeypatch, capsys):
    out = breakdown_main(monkeypatch, capsys, *two_passes, "--systems", "ours")
    assert "(medians over the passes)" in out
    assert "ours          115.0   115.0      99.0%" in out  # median of 100 and 130 ms
    assert "DID NOT REPRODUCE" in out  # 100 vs 130 ms
    assert "ours: 4 warm requests over 2 passes" in out
    wait = [line for line in out.splitlines() if line.strip().startswith("wait")][0].split()
    assert wait[1:] == ["30.0", "20.0", "40.0"]  # median / min / max over both passes' requests


def test_one_pass_with_pass(two_passes, monkeypatch, capsys):
    out = breakdown_main(monkeypatch, capsys, *two_passes, "--systems", "ours", "--pass", "1")
    assert "ours          130.0   130.0" in out and "medians over the passes" not in out
    assert "ours: 2 warm requests (median" in out
    wait = [line for line in out.splitlines() if line.strip().startswith("wait")][0].split()
    assert wait[1:] == ["40.0", "40.0", "40.0"]


def test_a_pass_that_is_not_in_the_file_is_said(two_passes, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="for pass 5"):
        breakdown_main(monkeypatch, capsys, *two_passes, "--pass", "5")


def test_the_committed_run_4_reads_as_before():
    """The README's 20K table and breakdown come from this file (one pass, from before passes)."""
    import subprocess
    res = BENCH / "results"
    out = subprocess.run([sys.executable, str(BENCH / "ttft_breakdown.py"),
                          str(res / "vllm026_ttft_20k_h100_2026-11-22_run4.jsonl"),
                          str(res / "vllm026_ttft_20k_h100_2026-11-22_run4_trace.jsonl")],
                         capture_output=True, text=True, check=True).stdout
    assert "ours          100.9   125.2      99.2%  1.27x" in out
    assert "lmcache        79.7   113.6      98.7%  1.00x" in out
    assert "ours: 10 warm requests (median" in out and "ours_async: 10 warm requests" in out
    assert "  wait           56.3    54.8    60.8" in out


def test_the_cold_table_compares_with_vllm_alone_and_null_is_no_peer(tmp_path, monkeypatch, capsys):
    """Round 0's mean per pass, the median over the passes, and its distance from vLLM alone; the
    connector that does nothing is not the best peer however fast its warm requests are."""
    runs = []
    for p, (base, null, ours) in enumerate([(0.480, 0.490, 0.495), (0.490, 0.500, 0.505), (0.500, 0.495, 0.500)]):
        for system, cold, warm in (("baseline", base, 0.480), ("null", null, 0.050), ("ours", ours, 0.090),
                                   ("lmcache", 0.560, 0.100)):
            run = engine_run(system, p, 1000.0 * p + len(runs), warm)
            run.update(cold_ttft_mean=cold, slot=system)
            runs.append(run)
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(x) + "\n" for x in [{"provenance": {}}, *runs]))
    (tmp_path / "t.jsonl").write_text("")
    out = breakdown_main(monkeypatch, capsys, str(results), str(tmp_path / "t.jsonl"), "--systems", "")
    cold = out.split("cold (")[1].split("\n\n")[0]
    lines = {line.split()[0]: line for line in cold.splitlines()[1:]}
    assert lines["baseline"].split()[1] == "490.0" and "vs vLLM alone" not in lines["baseline"]
    assert lines["null"].split()[1] == "495.0" and "+1.0 % vs vLLM alone" in lines["null"]
    assert lines["ours"].split()[1] == "500.0" and "+2.0 % vs vLLM alone" in lines["ours"]
    assert "(495.0 505.0 500.0)" in lines["ours"]
    table = out.split("cold (")[0]
    assert "ours" in table and "0.90x" in table  # against LMCache's 100 ms, not null's 50


def test_the_cold_timeline_lines_up_kvbm_and_the_null_connector():
    """Per cold request but the engine's first: the lookup, each step and its forward, and the
    first token after the last step; kvbm's event names and the null connector's."""
    rows = [{"round": 0, "user": u, "t0": 100.0 + u, "ttft_s": 0.480, "rows": None} for u in range(3)] + \
           [{"round": 1, "user": 0, "t0": 200.0, "ttft_s": 0.090}]
    ev = lambda what, t, **kw: {"what": what, "pid": 1, "t": t, **kw}  # noqa: E731
    kvbm, null = [], []
    for u in range(3):
        t0 = 100.0 + u
        kvbm += [ev("prepare_load", t0 + 0.008, ms=0.0), ev("step", t0 + 0.022, store_keys=1024),
                 ev("step_forward", t0 + 0.060, ms=30.0, cpu_ms=28.0), ev("step", t0 + 0.062, store_keys=234),
                 ev("step_forward", t0 + 0.100, ms=12.0, cpu_ms=11.0)]
        null += [ev("null_lookup", t0 + 0.007), ev("null_step", t0 + 0.012, tokens=16384),
                 ev("null_forward", t0 + 0.050, ms=29.0, cpu_ms=27.0), ev("null_step", t0 + 0.052, tokens=3700)]
    kvbm.append(ev("step", 100.0 + 2 + 0.6, store_keys=0))  # after the first token: not this request's
    (first, second) = ttft_breakdown.cold_timeline(rows, kvbm, ttft_breakdown.KVBM_COLD_EVENTS)
    assert first == pytest.approx({"ttft": 480.0, "lookup_at": 8.0, "step1_at": 22.0, "step2_at": 62.0, "fwd1": 30.0,
                                   "fwd1_cpu": 28.0, "fwd2": 12.0, "fwd2_cpu": 11.0, "after_last": 418.0})
    (n1, _) = ttft_breakdown.cold_timeline(rows, null, ttft_breakdown.COLD_EVENTS["null"])
    assert (n1["lookup_at"], n1["step1_at"], n1["step2_at"], n1["fwd1"]) == pytest.approx((7.0, 12.0, 52.0, 29.0))
    assert n1["fwd2"] != n1["fwd2"], "no second forward traced: nan"


def test_the_floor_is_the_front_end_plus_one_memcpy(tmp_path) -> None:
    h2d = tmp_path / "h2d.json"
    h2d.write_text(json.dumps({"rows": [{"way": "2 streams at once", "ms": 55.2},
                                        {"way": "one cudaMemcpyAsync", "ms": 54.62}]}))
    assert ttft_breakdown.one_memcpy_ms(str(h2d)) == 54.62
    assert ttft_breakdown.floor_line(6.8, 54.62, 0.0729) == \
        "floor: front 6.8 + one memcpy 54.62 = 61.4 ms; warm p50 72.9 ms = 1.19x the floor"
    assert ttft_breakdown.floor_line(6.8, 54.62, None) == "floor: front 6.8 + one memcpy 54.62 = 61.4 ms"


def test_landed_and_tail_split_a_layerwise_request_at_its_last_group() -> None:
    """t0 -> the last layer group landed (the copy sent early at 15 ms, the worker role's call 5 ms
    later, its last group 45 ms after that) and from there to the first token."""
    rows = [{"round": 0, "user": 0, "t0": 90.0, "ttft_s": 0.4},
            {"round": 1, "user": 0, "t0": 100.0, "ttft_s": 0.080}]
    t0 = 100.0
    events = [{"what": "prepare_load", "pid": 1, "t": t0 + 0.012, "req": "r", "ms": 3.0},
              {"what": "early_load", "pid": 1, "t": t0 + 0.015, "req": "r"},
              {"what": "load", "pid": 1, "t": t0 + 0.070, "req": "r", "submit_to_done_ms": 50.0,
               "blocks": 10, "copy_ms": 50.0, "landed_ms": [8.0, 45.0]},
              {"what": "finished", "pid": 1, "t": t0 + 0.078, "req": "r"}]
    (one,) = ttft_breakdown.breakdown(rows, events)
    assert (one["copy_start"], one["head_start"], one["last_group"]) == pytest.approx((15.0, 5.0, 45.0))
    assert one["landed"] == pytest.approx(65.0) and one["tail"] == pytest.approx(15.0)
    no_groups = [dict(e, landed_ms=[]) if e["what"] == "load" else e for e in events]
    (flat,) = ttft_breakdown.breakdown(rows, no_groups)
    assert flat["landed"] != flat["landed"] and flat["tail"] != flat["tail"], "no layer groups: nan"
