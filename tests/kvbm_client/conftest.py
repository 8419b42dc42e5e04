"""Shared fixtures of the client's unit tests."""
from __future__ import annotations

import importlib
import types
from typing import Callable

import pytest

CONNECTOR_PKG = "kvbm_client.connectors.vllm"


@pytest.fixture
def connector_module() -> Callable[[str], types.ModuleType]:
    """Import a submodule of the vLLM connector (those that need no vLLM import without it:
    the package imports ``KvbmConnector`` lazily)."""
    return lambda name: importlib.import_module(f"{CONNECTOR_PKG}.{name}")
