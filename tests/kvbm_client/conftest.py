"""Shared fixtures of the client's unit tests."""
from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Callable

import pytest

CONNECTOR_PKG = "kvbm_client.connectors.vllm"
CONNECTOR_DIR = Path(__file__).resolve().parents[2] / "kvbm_client/connectors/vllm"


@pytest.fixture
def connector_module(monkeypatch) -> Callable[[str], types.ModuleType]:
    """Import a submodule of the vLLM connector without vLLM: the package's ``__init__``
    imports vLLM, so a bare package module stands in for it (for this test only)."""
    pkg = types.ModuleType(CONNECTOR_PKG)
    pkg.__path__ = [str(CONNECTOR_DIR)]
    monkeypatch.setitem(sys.modules, CONNECTOR_PKG, pkg)
    for name in [n for n in sys.modules if n.startswith(CONNECTOR_PKG + ".")]:
        monkeypatch.delitem(sys.modules, name)
    return lambda name: importlib.import_module(f"{CONNECTOR_PKG}.{name}")
