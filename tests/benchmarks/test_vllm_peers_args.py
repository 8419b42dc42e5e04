"""The vLLM peers harness (benchmarks/vllm_peers.py) without a GPU: its arguments, the engine
kwargs of eager and CUDA-graphs mode, the command line of an engine process, and whole harness runs
with the engine processes replaced at the seam ``main(run_one=...)`` by a fake runner that returns
fixed result lines (no vLLM is imported)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import provenance  # noqa: E402
import vllm_peers  # noqa: E402

OURS_KTC = json.dumps({"kv_connector": "KvbmConnector", "kv_connector_module_path": "kvbm_client.connectors.vllm",
                       "kv_role": "kv_both", "kv_connector_extra_config": {}})


def test_defaults_are_one_eager_pass():
    args = vllm_peers.parse_args([])
    assert args.passes == 1 and args.cuda_graphs is False and args.pass_index == 0


@pytest.mark.parametrize("bad", [["--passes", "0"], ["--passes", "-2"], ["--systems", "baseline,vllm_native"],
                                 ["--systems", "baseline,,ours"]])
def test_bad_arguments_are_refused_before_any_engine_runs(bad, capsys):
    with pytest.raises(SystemExit) as e:
        vllm_peers.parse_args(bad)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_eager_is_the_default_mode():
    kw = vllm_peers.base_engine_kwargs(vllm_peers.parse_args(["--engine", "--system", "ours"]))
    assert kw["enforce_eager"] is True and "compilation_config" not in kw


@pytest.mark.parametrize("system", ["baseline", "null", "native", "lmcache", "ours", "ours_sync", "ours_async"])
def test_cuda_graphs_leave_compilation_and_graph_mode_to_vllm(system):
    kw = vllm_peers.base_engine_kwargs(vllm_peers.parse_args(["--engine", "--system", system, "--cuda-graphs"]))
    assert kw["enforce_eager"] is False and "compilation_config" not in kw


def test_the_null_system_runs_the_connector_that_does_nothing():
    kw, env = vllm_peers.system_kwargs("null", 24.0)
    assert kw == {"kv_transfer_config": {"kv_connector": "NullConnector", "kv_role": "kv_both",
                                         "kv_connector_module_path": "benchmarks.null_connector"}}
    assert env == {}
    sys.path.insert(0, str(Path(vllm_peers.__file__).resolve().parents[1]))
    import benchmarks.null_connector as null  # the module path vLLM imports; the class needs vLLM
    with pytest.raises(ImportError):
        null.NullConnector  # noqa: B018
    with pytest.raises(AttributeError):
        null.OtherConnector  # noqa: B018


def test_cuda_graphs_are_piecewise_for_a_connector_with_layer_hooks():
    kw = vllm_peers.base_engine_kwargs(vllm_peers.parse_args(["--engine", "--system", "dynamo", "--cuda-graphs"]))
    assert kw["enforce_eager"] is False and kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}


@pytest.mark.parametrize("graphs", [False, True])
def test_the_engine_process_gets_the_workload_the_pass_and_the_mode(graphs):
    argv = ["--systems", "baseline,ours", "--users", "5", "--sys-len", "0", "--ctx-len", "20000", "--turn-len", "128",
            "--max-len", "24576", "--g1-gb", "4", "--g2-gb", "12", "--max-tokens", "8", "--rounds", "2"]
    args = vllm_peers.parse_args(argv + (["--cuda-graphs"] if graphs else []))
    cmd = vllm_peers.engine_cmd("ours", 3, args)
    assert cmd[0] == sys.executable and cmd[1].endswith("benchmarks/vllm_peers.py")
    child = vllm_peers.parse_args(cmd[2:])
    assert child.engine and child.system == "ours" and child.pass_index == 3 and child.cuda_graphs is graphs
    for k in ("users", "rounds", "sys_len", "ctx_len", "turn_len", "max_len", "g1_gb", "g2_gb", "max_tokens", "model"):
        assert getattr(child, k) == getattr(args, k), k


def test_cold_before_warm_reaches_the_engine_and_its_prompts_share_nothing_with_the_workload():
    args = vllm_peers.parse_args(["--systems", "ours_layerwise", "--cold-before-warm"])
    child = vllm_peers.parse_args(vllm_peers.engine_cmd("ours_layerwise", 0, args)[2:])
    assert child.cold_before_warm is True
    plain = vllm_peers.engine_cmd("ours", 0, vllm_peers.parse_args([]))
    assert vllm_peers.parse_args(plain[2:]).cold_before_warm is False
    prompts = vllm_peers.cold_prompts(300)
    a, b = next(prompts), next(prompts)
    assert len(a) == len(b) == 300 and a != b
    firsts = {p[0] for _, _, p in vllm_peers.workload(3, 2, 16, 64, 8)}
    assert a[0] not in firsts and b[0] not in firsts, "a cold prompt's first block would match a user's"


def extra(system: str, pass_index: int) -> dict:
    kw, _ = vllm_peers.system_kwargs(system, 24.0, pass_index)
    return kw["kv_transfer_config"].get("kv_connector_extra_config", {})


def test_kvbm_gets_a_fresh_namespace_in_every_later_pass(monkeypatch):
    monkeypatch.setenv("OURS_KTC", OURS_KTC)
    assert "namespace" not in extra("ours", 0)  # pass 0: as before passes
    assert extra("ours", 1)["namespace"] == "ours_pass1"
    assert extra("ours_async", 0) == {"load_mode": "async", "namespace": "ours_async"}
    assert extra("ours_async", 2) == {"load_mode": "async", "namespace": "ours_async_pass2"}
    assert extra("ours_sync", 0) == {"load_mode": "sync", "namespace": "ours_sync"}
    assert extra("ours_layerwise_nostore", 1) == {"load_mode": "layerwise", "store_blocks": False,
                                                  "namespace": "ours_layerwise_nostore_pass1"}
    ktc = json.loads(OURS_KTC)
    ktc["kv_connector_extra_config"] = {"namespace": "mine", "load_mode": "sync"}
    monkeypatch.setenv("OURS_KTC", json.dumps(ktc))
    assert extra("ours", 1) == {"namespace": "mine_pass1", "load_mode": "sync"}


def test_a_v1_system_runs_its_base_system_under_vllms_v1_model_runner_one_step_at_a_time(monkeypatch):
    monkeypatch.setenv("OURS_KTC", OURS_KTC)
    for base in ("lmcache", "baseline", "ours_layerwise", "dynamo"):
        kw, env = vllm_peers.system_kwargs(base, 24.0)
        kw1, env1 = vllm_peers.system_kwargs(base + "_v1", 24.0)
        assert env1 == {**env, "VLLM_USE_V2_MODEL_RUNNER": "0"} and "VLLM_USE_V2_MODEL_RUNNER" not in env
        assert kw1.pop("async_scheduling") is False and "async_scheduling" not in kw
        if not base.startswith("ours"):
            assert kw1 == kw
    # kvbm's V1 variant keeps its base's settings in a key namespace of its own
    assert extra("ours_layerwise_v1", 0) == {"load_mode": "layerwise", "namespace": "ours_layerwise_v1"}
    assert extra("ours_layerwise_v1", 1)["namespace"] == "ours_layerwise_v1_pass1"
    assert extra("ours_v1", 0) == {"namespace": "ours_v1"}
    graphs = vllm_peers.base_engine_kwargs(
        vllm_peers.parse_args(["--engine", "--system", "dynamo_v1", "--cuda-graphs"]))
    assert graphs["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    both = "lmcache_v1,ours_layerwise_v1"
    assert vllm_peers.parse_args(["--systems", both]).systems == both
    with pytest.raises(SystemExit):
        vllm_peers.parse_args(["--systems", "lmcache_v1_v1"])


class FakeRunner:
    """Stands in for the engine processes: fixed result lines, warm p50 per (system, pass)."""

    def __init__(self, p50: dict[tuple[str, int], float]):
        self.p50, self.calls = p50, []

    def __call__(self, system: str, pass_index: int) -> dict:
        self.calls.append((system, pass_index))
        if (system, pass_index) not in self.p50:
            return {"system": system, "error": "engine died"}
        p50 = self.p50[system, pass_index]
        rows = [{"round": r, "user": 0, "tokens": 100, "ttft_s": p50, "t0": 1.0, "cached": 90 * (r > 0), "output": [1]}
                for r in range(3)]
        return {"system": system, "how": "plain", "warm_ttft_p50": p50, "warm_ttft_p90": p50 * 1.2,
                "warm_cached_frac": 0.9, "cudagraph_mode": "NONE", "rows": rows}


def harness(tmp_path, monkeypatch, extra_argv: list[str], runner: FakeRunner) -> tuple[list[dict], str]:
    monkeypatch.setenv("KVBM_BENCH_COMMIT", "0123abc")
    monkeypatch.setattr(provenance, "_gpus", lambda: [{"name": "NVIDIA H100 80GB HBM3", "driver": "1", "memory": "x"}])
    out = tmp_path / "out.jsonl"
    vllm_peers.main(["--model", str(tmp_path / "model"), "--out", str(out), *extra_argv], run_one=runner)
    return [json.loads(line) for line in out.read_text().splitlines()], str(out)


def test_two_passes_alternate_and_end_with_a_summary_per_system(tmp_path, monkeypatch, capsys):
    runner = FakeRunner({("baseline", 0): 0.400, ("ours", 0): 0.100, ("native", 0): 0.120,
                         ("baseline", 1): 0.404, ("ours", 1): 0.104, ("native", 1): 0.150})
    lines, _ = harness(tmp_path, monkeypatch, ["--systems", "baseline,ours,native", "--passes", "2"], runner)
    assert runner.calls == [("baseline", 0), ("ours", 0), ("native", 0), ("native", 1), ("ours", 1), ("baseline", 1)]
    head, results, sums = lines[0], lines[1:7], lines[7:]
    assert head["passes"] == 2 and head["mode"] == "eager"
    assert [(r["system"], r["pass"]) for r in results] == runner.calls
    assert all(r["mode"] == "eager" and len(r["rows"]) == 3 for r in results)
    assert [s["summary"] for s in sums] == ["baseline", "ours", "native"]
    s = {x["summary"]: x for x in sums}
    assert s["ours"]["warm_ttft_p50_median"] == pytest.approx(0.102)
    assert s["ours"]["warm_ttft_p50_passes"] == [0.100, 0.104]
    assert s["ours"]["reproduced"] is True and s["native"]["reproduced"] is False
    assert all(x["mode"] == "eager" for x in sums)
    printed = capsys.readouterr().out
    native_line = [line for line in printed.splitlines() if line.startswith("native ")][0]
    assert "DID NOT REPRODUCE" in native_line and "p50 passes differ by 25.0 %" in native_line


def test_every_line_records_the_mode_and_the_file_its_provenance(tmp_path, monkeypatch):
    runner = FakeRunner({("baseline", 0): 0.4, ("ours", 0): 0.1, ("baseline", 1): 0.4})  # ours fails in pass 1
    lines, _ = harness(tmp_path, monkeypatch, ["--systems", "baseline,ours", "--passes", "2", "--cuda-graphs"], runner)
    prov = lines[0]["provenance"]
    assert prov["commit"] == "0123abc" and prov["source"] == "KVBM_BENCH_COMMIT"
    assert "--cuda-graphs" in prov["argv"] and "--passes" in prov["argv"]
    assert [g["name"] for g in prov["machine"]["gpus"]] == ["NVIDIA H100 80GB HBM3"]
    assert all(line["mode"] == "graphs" for line in lines)
    failed = [line for line in lines if line.get("pass") == 1 and line.get("system") == "ours"]
    assert len(failed) == 1 and "error" in failed[0] and "rows" not in failed[0]
    ours = [line for line in lines if line.get("summary") == "ours"][0]
    assert ours["reproduced"] is False and ours["failed_passes"] == [1]


def test_one_pass_writes_what_the_harness_wrote_before_passes(tmp_path, monkeypatch, capsys):
    runner = FakeRunner({("baseline", 0): 0.4, ("ours", 0): 0.1})
    lines, _ = harness(tmp_path, monkeypatch, ["--systems", "baseline,ours,ours"], runner)
    assert runner.calls == [("baseline", 0), ("ours", 0), ("ours", 0)]
    assert list(lines[0]) == ["provenance", "mode", "passes"]
    assert [(line["system"], line["pass"], line["slot"]) for line in lines[1:]] == [
        ("baseline", 0, "baseline"), ("ours", 0, "ours"), ("ours", 0, "ours#2")]
    assert not any("summary" in line for line in lines)
    printed = capsys.readouterr().out
    assert "warm TTFT over" not in printed and "reproduce" not in printed


def test_hit_sources_turn_vllm_stats_on_and_reach_the_engine_process():
    args = vllm_peers.parse_args(["--systems", "lmcache", "--hit-sources"])
    assert vllm_peers.parse_args(vllm_peers.engine_cmd("lmcache", 0, args)[2:]).hit_sources
    kw = vllm_peers.base_engine_kwargs(vllm_peers.parse_args(["--engine", "--system", "lmcache", "--hit-sources"]))
    assert kw["disable_log_stats"] is False
    assert "disable_log_stats" not in vllm_peers.base_engine_kwargs(vllm_peers.parse_args(["--engine", "--system",
                                                                                           "lmcache"]))


def test_hit_counters_sum_vllm_counters_by_source():
    class Metric:
        def __init__(self, name, value):
            self.name, self.value = name, value

    class FakeLLM:
        def get_metrics(self):
            return [Metric("vllm:prefix_cache_hits", 32), Metric("vllm:prefix_cache_hits", 16),
                    Metric("vllm:external_prefix_cache_hits", 640), Metric("vllm:prefix_cache_queries", 999)]

    assert vllm_peers.hit_counters(FakeLLM()) == {"g1_hit_tokens": 48, "external_hit_tokens": 640}


def test_hit_fractions_are_of_the_warm_rounds_prompt_tokens():
    rows = [{"round": 0, "tokens": 1000, "cached": 0, "g1_hit_tokens": 0, "external_hit_tokens": 0},
            {"round": 1, "tokens": 1000, "cached": 900, "g1_hit_tokens": 100, "external_hit_tokens": 800},
            {"round": 2, "tokens": 1000, "cached": 900, "g1_hit_tokens": 300, "external_hit_tokens": 600}]
    assert vllm_peers.hit_fractions(rows) == {"warm_g1_frac": 0.2, "warm_external_frac": 0.7}
    assert vllm_peers.hit_fractions([{"round": 1, "tokens": 5}]) == {}


def test_hit_fractions_are_not_measured_where_the_counters_missed_the_cached_tokens():
    """kvbm's rows on vLLM 0.26 (2026-11-26): 7424 tokens cached, both counters 0: unknown, not 0 %."""
    rows = [{"round": 1, "tokens": 7712, "cached": 7424, "g1_hit_tokens": 0, "external_hit_tokens": 0}]
    assert vllm_peers.hit_fractions(rows) == {"warm_g1_frac": None, "warm_external_frac": None}


def test_the_warmup_turn_reaches_every_engine_process_and_takes_a_user_of_its_own():
    assert vllm_peers.parse_args([]).warmup_turn is False
    args = vllm_peers.parse_args(["--systems", "ours", "--warmup-turn", "--ctx-len", "300", "--sys-len", "20"])
    assert vllm_peers.parse_args(vllm_peers.engine_cmd("ours", 1, args)[2:]).warmup_turn
    assert not vllm_peers.parse_args(vllm_peers.engine_cmd("ours", 1, vllm_peers.parse_args([]))[2:]).warmup_turn
    # the untimed user's two turns: the second extends the first (a hit), and neither is a timed user's prompt
    (_, _, first), (_, _, second) = vllm_peers.workload(1, 2, 20, 300, 64, seed=99991)
    assert second[:len(first)] == first and len(second) > len(first)
    timed = [p for _, _, p in vllm_peers.workload(8, 3, 20, 300, 64)]
    assert all(p[20:340] != first[20:340] for p in timed)


def test_an_engines_stdout_log_lines_are_kept_beside_its_stderr(tmp_path, monkeypatch):
    # a stand-in for the engine process: vLLM's log line on stdout, the result line, a line on stderr
    script = ("import sys; print('INFO vllm: engine started'); "
              "print('{\"system\": \"ours\", \"rows\": []}'); print('a warning', file=sys.stderr)")
    monkeypatch.setattr(vllm_peers, "engine_cmd", lambda name, pass_index, args: [sys.executable, "-c", script])
    monkeypatch.setenv("OURS_KTC", OURS_KTC)
    args = vllm_peers.parse_args(["--systems", "ours", "--logdir", str(tmp_path), "--timeout", "60"])
    res = vllm_peers.run_engine("ours", 0, args)
    assert res["system"] == "ours" and res["rows"] == []
    out = (tmp_path / "ours.stdout.log").read_text()
    assert "INFO vllm: engine started" in out and '{"system"' not in out and out.startswith("===== pass 0 =====")
    assert "a warning" in (tmp_path / "ours.stderr.log").read_text()
