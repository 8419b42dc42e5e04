"""The concurrent driver of the vLLM peers harness (benchmarks/peer_concurrent.py) without vLLM: a
fake ``generate`` (a clearly named stand-in for the engine, on the real clock and event loop) that
answers after a delay, so that the tests can see when requests were sent, that they overlap, and
what the run's figures are."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peer_concurrent as pc  # noqa: E402
import vllm_peers  # noqa: E402


class FakeEngine:
    """Answers ``tokens`` tokens, the first after ``first_s`` and each later one ``gap_s`` apart;
    records when each request came and ended, and how many were in flight at once."""

    def __init__(self, first_s=0.03, gap_s=0.005, tokens=1, fail=None):
        self.first_s, self.gap_s, self.tokens, self.fail = first_s, gap_s, tokens, fail
        self.log: list[tuple[str, str]] = []
        self.inflight = self.most = 0

    async def generate(self, prompt, rid):
        self.log.append(("start", rid))
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        try:
            await asyncio.sleep(self.first_s)
            if rid == self.fail:
                raise RuntimeError("engine died")
            for n in range(1, self.tokens + 1):
                if n > 1:
                    await asyncio.sleep(self.gap_s)
                yield list(range(n)), len(prompt) // 2
        finally:
            self.inflight -= 1
            self.log.append(("end", rid))


def turns(users=3, rounds=2):
    return {u: [(r, [u] * (10 + r)) for r in range(rounds)] for u in range(users)}


def test_users_overlap_and_each_users_turns_stay_in_order():
    fake = FakeEngine(first_s=0.05)
    rows = asyncio.run(pc.drive(fake.generate, turns(3, 3), [], pc.Plan(stagger_ms=10, think_ms=5)))
    assert len(rows) == 9 and {r["kind"] for r in rows} == {"user"}
    assert fake.most == 3, "the users' requests should have been in flight together"
    for u in range(3):
        starts = [i for i, (what, rid) in enumerate(fake.log) if what == "start" and rid.startswith(f"u{u}r")]
        ends = [i for i, (what, rid) in enumerate(fake.log) if what == "end" and rid.startswith(f"u{u}r")]
        assert all(ends[k] < starts[k + 1] for k in range(2)), f"user {u} sent a turn before the last ended"
    assert all(r["ttft_s"] >= 0.045 for r in rows) and all(r["cached"] == r["tokens"] // 2 for r in rows)
    assert pc.overlap_s(rows) > 0.05


def test_users_start_stagger_ms_apart_and_strangers_arrive_every_gap():
    fake = FakeEngine(first_s=0.01)
    plan = pc.Plan(stagger_ms=40, think_ms=0, strangers=2, stranger_gap_ms=100)
    rows = asyncio.run(pc.drive(fake.generate, turns(3, 1), [[7] * 20, [8] * 20, [9] * 20], plan))
    first = {r["user"]: r["t0_s"] for r in rows}
    assert first[1] - first[0] == pytest.approx(0.04, abs=0.02) and first[2] - first[0] == pytest.approx(0.08, abs=0.02)
    strangers = sorted((r for r in rows if r["kind"] == "stranger"), key=lambda r: r["t0_s"])
    assert [r["user"] for r in strangers] == [-1, -2], "only --strangers of the prompts given are sent"
    assert strangers[0]["t0_s"] == pytest.approx(0.1, abs=0.03) and strangers[1]["t0_s"] == pytest.approx(0.2, abs=0.03)
    assert all(r["tokens"] == 20 and r["round"] == 0 for r in strangers)


def test_token_gaps_and_throughput_with_more_than_one_token():
    fake = FakeEngine(first_s=0.02, gap_s=0.01, tokens=5)
    rows = asyncio.run(pc.drive(fake.generate, turns(2, 1), [], pc.Plan(stagger_ms=0, think_ms=0)))
    assert all(len(r["token_gaps_s"]) == 4 and r["output"] == [0, 1, 2, 3, 4] for r in rows)
    s = pc.stats(rows)
    assert s["tpot_p50"] == pytest.approx(0.01, abs=0.006) and s["requests"] == 2
    # 10 tokens in about 0.06 s; the loop's overhead only slows it
    assert 60 < s["out_tok_per_s"] <= 10 / 0.06 + 1
    assert "stranger_ttft_p50" not in s


def test_an_output_without_new_tokens_is_no_gap():
    async def repeats(prompt, rid):
        for tokens in ([0], [0, 1], [0, 1], [0, 1, 2]):
            await asyncio.sleep(0.01)
            yield tokens, 0

    (row,) = asyncio.run(pc.drive(repeats, turns(1, 1), [], pc.Plan()))
    assert len(row["token_gaps_s"]) == 2 and row["output"] == [0, 1, 2]
    assert row["token_gaps_s"][1] >= 0.018, "the gap runs from the last output that brought a token"


def test_a_failed_request_fails_the_run():
    fake = FakeEngine(fail="u1r1")
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(pc.drive(fake.generate, turns(2, 2), [], pc.Plan(stagger_ms=0, think_ms=0)))


def test_a_request_without_output_fails_the_run():
    async def silent(prompt, rid):
        return
        yield  # pragma: no cover

    with pytest.raises(RuntimeError, match="without an output"):
        asyncio.run(pc.drive(silent, turns(1, 1), [], pc.Plan()))


def test_overlap_counts_only_time_with_two_or_more_in_flight():
    rows = [{"t0_s": 0.0, "end_s": 1.0}, {"t0_s": 0.5, "end_s": 2.0}, {"t0_s": 3.0, "end_s": 4.0}]
    assert pc.overlap_s(rows) == 0.5
    assert pc.overlap_s(rows[:1]) == 0


@pytest.mark.parametrize("bad", [dict(stagger_ms=-1), dict(think_ms=-0.5), dict(strangers=-1),
                                 dict(stranger_gap_ms=-3)])
def test_a_plan_refuses_negative_values(bad):
    with pytest.raises(ValueError, match="must be >= 0"):
        pc.Plan(**bad)


def test_concurrent_mode_reaches_the_engine_process_with_its_plan():
    args = vllm_peers.parse_args(["--systems", "lmcache,ours_layerwise", "--concurrent", "--strangers", "4",
                                  "--think-ms", "250", "--stagger-ms", "20", "--stranger-gap-ms", "500"])
    child = vllm_peers.parse_args(vllm_peers.engine_cmd("ours_layerwise", 1, args)[2:])
    assert child.concurrent and (child.strangers, child.think_ms, child.stagger_ms, child.stranger_gap_ms) == (
        4, 250.0, 20.0, 500.0)
    plain = vllm_peers.parse_args(vllm_peers.engine_cmd("ours", 0, vllm_peers.parse_args([]))[2:])
    assert plain.concurrent is False


@pytest.mark.parametrize("bad,says", [(["--concurrent", "--cold-before-warm"], "--cold-before-warm"),
                                      (["--concurrent", "--hit-sources"], "--hit-sources"),
                                      (["--concurrent", "--strangers", "-1"], "--strangers must be >= 0"),
                                      (["--think-ms", "-5"], "--think-ms must be >= 0"),
                                      (["--stranger-gap-ms", "-1"], "--stranger-gap-ms must be >= 0")])
def test_concurrent_mode_refuses_what_it_cannot_measure(bad, says, capsys):
    with pytest.raises(SystemExit) as e:
        vllm_peers.parse_args(bad)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error:" in err and says in err


def test_the_result_line_counts_only_users_as_warm_and_cold(capsys):
    args = vllm_peers.parse_args(["--engine", "--system", "baseline", "--concurrent"])
    rows = [{"kind": "user", "round": 0, "user": 0, "tokens": 100, "ttft_s": 0.5, "cached": 0, "output": [1]},
            {"kind": "user", "round": 1, "user": 0, "tokens": 120, "ttft_s": 0.1, "cached": 96, "output": [1]},
            {"kind": "stranger", "round": 0, "user": -1, "tokens": 100, "ttft_s": 9.0, "cached": 0, "output": [1]}]
    vllm_peers.summarize_engine(args, "plain", 1.0, None, rows, {"concurrent": {"requests": 3}})
    import json
    line = json.loads(capsys.readouterr().out)
    assert line["warm_ttft_p50"] == 0.1 and line["cold_ttft_mean"] == 0.5 and line["warm_cached_frac"] == 0.8
    assert line["concurrent"] == {"requests": 3} and len(line["rows"]) == 3 and line["cudagraph_mode"] is None
