"""Suite-wide collection order: the longest test files first.

``make test`` runs the suite on two pytest-xdist workers with ``--dist loadfile``: a file runs
whole on one worker, and the files are handed out in collection order as workers free up. In
directory order the vLLM files (the longest, 1-7 minutes each) came last, so one worker was
still running the last of them long after the other had run out of work. Handing out the
longest files first (greedy longest-first scheduling) lets both workers end together; the order
within a file and among the other files is unchanged.
"""
from __future__ import annotations

import pytest

#: The files that took longest (``pytest --durations``, the 2-core VM, 2026-11-27: setup and
#: calls, seconds), longest first. A file missing from the tree is ignored; a new long file
#: belongs here.
LONGEST_FIRST = (
    "vllm/test_vllm_faults.py",  # ~440
    "vllm/test_vllm_connector.py",  # ~300
    "stress/test_stress_short.py",  # ~170
    "vllm/test_vllm_multi_engine.py",  # ~160
    "vllm/test_vllm_persist.py",  # ~125
    "stress/test_windows_daemons.py",  # ~120
    "vllm/test_vllm_restart.py",  # ~70
    "cluster/test_cluster_soak.py",  # ~65
    "vllm/test_null_connector.py",  # ~25
    "disagg/test_hma_agreement.py",  # ~25
)


def _rank(item: pytest.Item) -> int:
    path = item.path.as_posix()
    for rank, name in enumerate(LONGEST_FIRST):
        if path.endswith("/tests/" + name):
            return rank
    return len(LONGEST_FIRST)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: every file's own order, and the others' order, is kept
