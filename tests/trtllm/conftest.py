"""Put the ``tensorrt_llm`` stand-ins on ``sys.path`` for the tests of this folder (only)."""
from __future__ import annotations

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
