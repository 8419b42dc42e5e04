"""Put the ``tensorrt_llm`` stand-ins on ``sys.path`` for the tests of this folder (only); the
``kvbm_node`` fixture runs the real kvbm daemons for the tests of kvbm's connector."""
from __future__ import annotations

import os
import sys
from pathlib import Path

STANDINS = str(Path(__file__).parent / "standins")
if STANDINS not in sys.path:
    sys.path.insert(0, STANDINS)

import tensorrt_llm  # noqa: E402

assert getattr(tensorrt_llm, "__standin__", False), (
    f"tests/trtllm must run against the stand-in, but {tensorrt_llm.__file__} was imported")


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The driver's tensors are small; on a shared 2-core machine torch's intra-op threads only
    add contention (10x slower indexing measured). Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def kvbm_node(tmp_path, monkeypatch):
    """Factory: ``kvbm_node(device="cpu", tp=1, connector=None, start=True, **DYN_KVBM_* settings)``
    starts a leader and ``tp`` worker daemons and points this process's environment (where the
    driver's connector runs) at them; every node is stopped after the test."""
    from .kvbm_node import KvbmNode

    nodes = []

    def make(device: str = "cpu", tp: int = 1, connector=None, start: bool = True, **env: str):
        root = tmp_path / f"node{len(nodes)}"
        root.mkdir()
        node = KvbmNode(root, device, tp, connector, **env)
        nodes.append(node)
        engine_env = node.engine_env()
        for name in [n for n in os.environ if n.startswith("DYN_KVBM_") and n not in engine_env]:
            monkeypatch.delenv(name)
        for name, value in engine_env.items():
            monkeypatch.setenv(name, value)
        return node.start_all() if start else node

    yield make
    for node in nodes:
        node.stop()
