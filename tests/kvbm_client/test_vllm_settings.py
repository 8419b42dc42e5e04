"""The connector's settings (``kv_connector_extra_config`` over ``DYN_KVBM_*``), without vLLM."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "kvbm_client/connectors/vllm/settings.py"


@pytest.fixture(scope="module")
def settings():
    spec = importlib.util.spec_from_file_location("kvbm_client.connectors.vllm.settings", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_loads_are_synchronous_unless_asked(settings, monkeypatch):
    monkeypatch.setenv("DYN_KVBM_SOCKET_DIR", "/run/kvbm-test")
    s = settings.ConnectorSettings.from_extra({}, "model|bf16|16")
    assert s.load_mode == "sync"
    assert s.leader_address == "unix:/run/kvbm-test/leader.sock"
    assert s.worker_address("3") == "unix:/run/kvbm-test/worker-3.sock"
    assert settings.ConnectorSettings.from_extra({"load_mode": "ASYNC"}, "ns").load_mode == "async"


def test_unknown_load_mode_is_refused_with_the_choices(settings):
    with pytest.raises(ValueError, match="load_mode='eager': one of sync, async"):
        settings.ConnectorSettings.from_extra({"load_mode": "eager"}, "ns")
