"""One vLLM cache directory per test process, for the tests that start vLLM engines: a conftest
that starts engines imports :func:`shared_vllm_cache` (an autouse session fixture)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


def share_vllm_cache(tmp_path_factory) -> Path:
    """Set ``VLLM_CACHE_ROOT`` for every engine this test process starts (unless one is set).

    vLLM inspects a model class in a child interpreter (a second import of vLLM and torch:
    ~17 s on the 2-core CI machine) unless the result is cached there (``modelinfos``, written
    atomically, keyed by the model module's hash), so a fresh cache per engine run paid that
    on every run."""
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    return Path(os.environ["VLLM_CACHE_ROOT"])


@pytest.fixture(scope="session", autouse=True)
def shared_vllm_cache(tmp_path_factory) -> Path:
    """vLLM's model inspection cached once for every engine of this process (:func:`share_vllm_cache`)."""
    return share_vllm_cache(tmp_path_factory)
