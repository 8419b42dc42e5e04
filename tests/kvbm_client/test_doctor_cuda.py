"""`kvbm doctor`'s CUDA checks. Without a GPU: "no CUDA" is a skip, or a failure when --gpus
asks for GPU workers. With one: devices, cudaHostRegister pinning, an IPC handle opened by a
second process, the H2D benchmark, and the IPC failure an expandable-segments allocator causes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbm_client.doctor import cuda
from kvbm_client.doctor.base import DoctorContext, DoctorOptions, Status

REPO = Path(__file__).resolve().parents[2]


def has_cuda() -> bool:
    if not any(os.path.exists(p) for p in cuda.DRIVER_FILES):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


gpu = pytest.mark.skipif(not has_cuda(), reason="needs a CUDA device")
no_gpu = pytest.mark.skipif(has_cuda(), reason="checks the no-CUDA answers")
CHECKS = (cuda.check_devices, cuda.check_pinned, cuda.check_ipc, cuda.check_bench_h2d)


def ctx_of(options: DoctorOptions | None = None) -> DoctorContext:
    return DoctorContext.from_env({"DYN_KVBM_CPU_CACHE_GB": "1"}, options)


@no_gpu
def test_no_cuda_is_a_clear_skip() -> None:
    for check in CHECKS:
        result = check(ctx_of())
        assert result.status is Status.SKIP and result.message.startswith("no CUDA: ")


@no_gpu
def test_no_cuda_fails_when_gpus_are_asked_for() -> None:
    for check in CHECKS:
        result = check(ctx_of(DoctorOptions(gpus=(0,))))
        assert result.status is Status.FAIL
        assert "but --gpus asks for GPU workers" in result.message
        assert result.remedy == "install the NVIDIA driver and a CUDA build of torch, or run CPU workers"


@gpu
def test_devices_visible() -> None:
    result = cuda.check_devices(ctx_of(DoctorOptions(gpus=(0,))))
    assert result.status is Status.OK and result.data["devices"] >= 1


@gpu
def test_device_out_of_range_fails() -> None:
    result = cuda.check_devices(ctx_of(DoctorOptions(gpus=(0, 99))))
    assert result.status is Status.FAIL and "--gpus 99 not visible" in result.message
    assert "CUDA_VISIBLE_DEVICES" in result.remedy


@gpu
def test_pinned_round_trip() -> None:
    result = cuda.check_pinned(ctx_of(DoctorOptions(gpus=(0,))))
    assert result.status is Status.OK and "cudaHostRegister" in result.message


@gpu
def test_ipc_opened_by_another_process() -> None:
    result = cuda.check_ipc(ctx_of(DoctorOptions(gpus=(0,))))
    assert result.status is Status.OK
    assert result.message == "16 MiB exported on GPU 0, opened by another process, same bytes"


@gpu
def test_ipc_fails_with_expandable_segments(tmp_path: Path) -> None:
    """torch's expandable segments have no cudaIpcMemHandle_t: the engine cannot export."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "DYN_KVBM_CPU_CACHE_GB": "1", "DYN_KVBM_SOCKET_DIR": str(tmp_path / "sock")}
    done = subprocess.run([sys.executable, "-m", "kvbm_client.cli", "doctor", "--json", "--gpus", "0"],
                          env=env, capture_output=True, text=True, timeout=120)
    ipc = next(c for c in json.loads(done.stdout)["checks"] if c["check"] == "cuda.ipc")
    assert ipc["status"] == "fail" and "expandable" in ipc["message"]
    assert ipc["remedy"] == "unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments"
    assert done.returncode == 1


@gpu
def test_bench_h2d() -> None:
    result = cuda.check_bench_h2d(ctx_of(DoctorOptions(gpus=(0,), bench_h2d=True)))
    assert result.status is Status.INFO and result.data["h2d_gbps"] > 1
