"""Where a benchmark result came from: the commit (and whether the tree differed from it), the
command line, the settings in the environment, and the machine.

Every benchmark that writes a result file puts :func:`provenance` in it: as the first line of a
``.jsonl`` (``{"provenance": {...}}``) or under the key ``"provenance"`` of a ``.json``.

Nothing here is guessed: a value that cannot be read is recorded as None. On a copy of the tree
without ``.git`` (a device machine), set ``KVBM_BENCH_COMMIT`` to the commit that was copied.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: Environment variables that change what a benchmark measures (recorded with their values).
SETTING_PREFIXES = ("DYN_KVBM_", "KVBM_", "OURS_", "VLLM_", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "DYN_LOG",
                    "PYTHONPATH")
PACKAGES = ("kvbm", "torch", "vllm", "grpcio", "numpy", "nixl-cu13", "cuda-python", "cuda-bindings", "lmcache")


def _run(*argv: str) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> dict[str, Any]:
    """HEAD of the checkout and whether tracked files differ from it; ``KVBM_BENCH_COMMIT`` wins
    (a device machine's copy may carry a stale ``.git``)."""
    if os.environ.get("KVBM_BENCH_COMMIT"):
        return {"commit": os.environ["KVBM_BENCH_COMMIT"], "dirty": None, "source": "KVBM_BENCH_COMMIT"}
    head = _run("git", "rev-parse", "HEAD")
    if head is None:
        return {"commit": os.environ.get("KVBM_BENCH_COMMIT"), "dirty": None, "source": "KVBM_BENCH_COMMIT"}
    status = _run("git", "status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": bool(status) if status is not None else None, "source": "git"}


def _cpu_model() -> str | None:
    """The CPU's model name, with its family, model and stepping where /proc/cpuinfo has them: a
    cloud VM's name can be generic ("Intel(R) Xeon(R) Processor") where the numbers tell hosts
    apart (family 6 model 143: Sapphire Rapids; 207: Emerald Rapids)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "stepping") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break  # (the first processor's block is enough)
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or None
    numbers = ", ".join(f"{k} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields)
    return f"{name} ({numbers})" if name and numbers else name


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[dict[str, str]] | None:
    """Name, driver, memory and PCIe link (generation x width, now) of each GPU, from nvidia-smi;
    None where there is none to ask."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = _run("nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
               "pcie.link.width.current", "--format=csv,noheader")
    if out is None:
        return None
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    return [{"name": r[0], "driver": r[1], "memory": r[2], "pcie": f"gen {r[3]} x{r[4]}"} for r in rows if len(r) == 5]


def _torch_view() -> dict[str, Any] | None:
    """What torch sees, only if the benchmark already imported it (importing it costs seconds)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    view: dict[str, Any] = {"cuda_available": bool(torch.cuda.is_available()), "cuda": torch.version.cuda}
    if view["cuda_available"]:
        view["device"] = torch.cuda.get_device_name(0)
    return view


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def machine() -> dict[str, Any]:
    return {"host": socket.gethostname(), "platform": platform.platform(), "cpu": _cpu_model(),
            "cores": os.cpu_count(), "ram_bytes": _ram_bytes(), "gpus": _gpus(), "torch": _torch_view(),
            "versions": _versions()}


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """The record every result file starts with (call it when the run starts)."""
    return {**commit(), "argv": [sys.executable, *(sys.argv if argv is None else argv)],
            "cwd": os.getcwd(), "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith(SETTING_PREFIXES)},
            "machine": machine()}


def header_line(argv: list[str] | None = None) -> str:
    """:func:`provenance` as the first line of a ``.jsonl`` result file."""
    import json
    return json.dumps({"provenance": provenance(argv)}) + "\n"


if __name__ == "__main__":  # python benchmarks/provenance.py: what a result file would record here
    import json
    print(json.dumps(provenance(), indent=1))
