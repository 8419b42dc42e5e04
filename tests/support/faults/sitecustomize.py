"""Fault injection for kvbm tests: put this directory first on a daemon's PYTHONPATH and set
KVBM_FAULT_* in its environment (the production worker never reads KVBM_FAULT_*).

Python imports ``sitecustomize`` at start-up; when a KVBM_FAULT_* variable is set, this one
installs :mod:`kvbm_faults`, which patches the worker's copy functions as its modules are
imported (nothing is imported early, so other processes given this path are unaffected).
"""
from __future__ import annotations

import os

if any(k.startswith("KVBM_FAULT_") for k in os.environ):
    import kvbm_faults

    kvbm_faults.install()
