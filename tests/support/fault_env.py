"""The daemon environment that installs the test-only fault wrapper (``tests/support/faults``).

The production worker reads no ``KVBM_FAULT_*``: a test that wants a fault puts
``tests/support/faults`` first on the daemon's ``PYTHONPATH`` (its ``sitecustomize`` patches
the worker's copy functions) and sets the variables, e.g.
``fault_env(CORRUPT_LOADS="1")`` → ``{"PYTHONPATH": ".../faults:...", "KVBM_FAULT_CORRUPT_LOADS": "1"}``.
"""
from __future__ import annotations

import os
from pathlib import Path

FAULTS = Path(__file__).resolve().parent / "faults"


def fault_env(**faults: str) -> dict[str, str]:
    """Overrides for a daemon's environment: the fault wrapper plus ``KVBM_FAULT_<NAME>`` per keyword."""
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **{f"KVBM_FAULT_{name}": value for name, value in faults.items()}}
