"""Real filesystems mounted for a test (mounting needs root; the test skips otherwise)."""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def mounted(target: Path, fstype: str, options: str = "", source: str | None = None) -> Iterator[Path]:
    """Mount ``fstype`` at ``target`` (created) for the block, unmounted after it."""
    target.mkdir(parents=True, exist_ok=True)
    argv = ["mount", "-t", fstype, *(["-o", options] if options else []), source or fstype, str(target)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here ({done.stderr.strip()}); these tests need root")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=True)
