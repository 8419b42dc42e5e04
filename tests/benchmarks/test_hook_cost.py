"""The hook-cost wrapper (benchmarks/hook_cost.py) around stand-in connectors (vLLM is not installed
in the test environment): hooks pass through, only the connector's own hooks are wrapped, and
every REPORT_EVERY steps a role writes its running totals into the trace."""
from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import hook_cost  # noqa: E402
import vllm_peers  # noqa: E402


# a stand-in for vLLM's base class, in the module whose defaults are not to be wrapped
base_module = types.ModuleType(hook_cost.VLLM_BASE)
exec("class Base:\n    def save_kv_layer(self, *a, **k):\n        return None\n"
     "    def has_pending_push_work(self):\n        return False\n", base_module.__dict__)
Base = base_module.Base


class StandIn(Base):
    """A stand-in connector: a scheduler hook, worker hooks (one of them slow), one not a hook."""

    def build_connector_meta(self, out):
        return {"meta": out}

    def wait_for_layer_load(self, layer):
        time.sleep(0.002)

    def wait_for_save(self):
        return "saved"

    def helper(self):
        return 7


@pytest.fixture
def traced(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    from kvbm_client.connectors.core import tracing
    monkeypatch.setattr(tracing, "TRACE_PATH", str(path))
    return path


def test_only_the_connectors_own_hooks_are_wrapped_and_results_pass_through():
    assert hook_cost.own_hooks(StandIn) == ["build_connector_meta", "wait_for_layer_load", "wait_for_save"]
    cls = hook_cost.costed(StandIn)
    assert cls.__name__ == "CostedStandIn" and issubclass(cls, StandIn)
    assert cls.save_kv_layer is Base.save_kv_layer and cls.has_pending_push_work is Base.has_pending_push_work
    assert cls.helper is StandIn.helper
    conn = cls()
    assert conn.build_connector_meta("x") == {"meta": "x"} and conn.wait_for_save() == "saved"


def test_each_role_reports_its_running_totals_every_report_every_steps(traced, monkeypatch):
    monkeypatch.setattr(hook_cost, "REPORT_EVERY", 4)
    sched, worker = hook_cost.costed(StandIn)(), hook_cost.costed(StandIn)()
    for step in range(9):
        sched.build_connector_meta(step)
        for layer in range(3):
            worker.wait_for_layer_load(f"l{layer}")
        worker.wait_for_save()
    events = [json.loads(line) for line in traced.read_text().splitlines()]
    assert [(e["role"], e["steps"]) for e in events] == [("scheduler", 4), ("worker", 4), ("scheduler", 8),
                                                          ("worker", 8)]
    last = events[-1]
    assert last["calls"] == {"wait_for_layer_load": 24, "wait_for_save": 8}
    assert last["ms"]["wait_for_layer_load"] >= 24 * 2 and last["ms"]["wait_for_save"] < last["ms"]["wait_for_layer_load"]
    assert last["since_s"] * 1e3 >= last["ms"]["wait_for_layer_load"]
    assert events[-2]["calls"] == {"build_connector_meta": 8}


def test_a_hook_that_raises_is_counted_and_the_error_passes_through():
    class Failing(StandIn):
        def wait_for_save(self):
            raise RuntimeError("boom")

    conn = hook_cost.costed(Failing)()
    with pytest.raises(RuntimeError, match="boom"):
        conn.wait_for_save()
    assert conn._hook_costs.calls == {"wait_for_save": 1}


def test_the_class_vllm_asks_for_needs_its_connector_and_unknown_names_fail():
    with pytest.raises(AttributeError):
        hook_cost.CostedNoSuchConnector  # noqa: B018
    with pytest.raises(ImportError):  # (vLLM is not installed in the test environment)
        hook_cost.CostedLMCacheConnectorV1  # noqa: B018


def test_hooked_systems_run_their_connector_through_this_module(monkeypatch):
    monkeypatch.setenv("OURS_KTC", json.dumps({"kv_connector": "KvbmConnector", "kv_role": "kv_both",
                                               "kv_connector_module_path": "kvbm_client.connectors.vllm"}))
    for name, connector in (("lmcache_hooks", "CostedLMCacheConnectorV1"), ("null_hooks", "CostedNullConnector"),
                            ("ours_layerwise_hooks", "CostedKvbmConnector"), ("ours_hooks_v1", "CostedKvbmConnector")):
        kw, env = vllm_peers.system_kwargs(name, 24)
        plain = name.replace("_hooks", "")
        kw0, env0 = vllm_peers.system_kwargs(plain, 24)
        ktc, ktc0 = kw.pop("kv_transfer_config"), kw0.pop("kv_transfer_config")
        assert ktc["kv_connector"] == connector and ktc["kv_connector_module_path"] == "benchmarks.hook_cost"
        assert kw == kw0 and env == env0
        assert vllm_peers.base_system(name) == vllm_peers.base_system(plain)
        assert {k: v for k, v in ktc.items() if k not in ("kv_connector", "kv_connector_module_path",
                                                          "kv_connector_extra_config")} == \
               {k: v for k, v in ktc0.items() if k not in ("kv_connector", "kv_connector_module_path",
                                                           "kv_connector_extra_config")}
    assert vllm_peers.parse_args(["--systems", "ours_layerwise_hooks,lmcache_hooks_v1"]).systems
