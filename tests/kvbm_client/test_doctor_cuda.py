"""`kvbm doctor`'s CUDA checks. Without a GPU: "no CUDA" is a skip, or a failure when --gpus
asks for GPU workers; the torch build is read without importing torch. With a GPU: devices,
cudaHostRegister pinning, an IPC handle opened by a second process, the H2D benchmark."""
from __future__ import annotations

import os

import pytest

from kvbm_client.doctor import cuda
from kvbm_client.doctor.base import DoctorContext, DoctorOptions, Status


def has_cuda() -> bool:
    if not any(os.path.exists(p) for p in cuda.DRIVER_FILES):
        return False
    try:
        rt = cuda.runtime()
    except ImportError:
        return False
    err, count = rt.cudaGetDeviceCount()
    return err == rt.cudaError_t.cudaSuccess and count > 0


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
        assert result.remedy.startswith("install the NVIDIA driver and cuda-python")


def test_torch_build_is_read_without_importing_torch() -> None:
    torch = pytest.importorskip("torch")
    assert cuda.torch_build() == (torch.__version__, torch.version.cuda)


def test_torch_newer_than_the_driver_is_a_problem() -> None:
    torch = pytest.importorskip("torch")
    if not torch.version.cuda:
        assert cuda._torch_problem(13000).endswith("is a CPU-only build")
        return
    major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
    own = major * 1000 + minor * 10
    assert cuda._torch_problem(own) == ""
    assert cuda._torch_problem(own - 1000) == (f"torch {torch.__version__} needs CUDA {torch.version.cuda}, "
                                               f"the driver supports {major - 1}.{minor}")


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
def test_ipc_child_refuses_a_handle_that_was_never_exported() -> None:
    """The importing side's failure path: 64 zero bytes are no handle of this machine."""
    failure = cuda._run_child(0, bytes(64), "0" * 64)
    assert failure is not None and failure.status is Status.FAIL
    assert "cudaIpcOpenMemHandle" in failure.message
    assert "--ipc=host" in failure.remedy


@gpu
def test_bench_h2d() -> None:
    result = cuda.check_bench_h2d(ctx_of(DoctorOptions(gpus=(0,), bench_h2d=True)))
    assert result.status is Status.INFO and result.data["h2d_gbps"] > 1


def test_a_staging_area_must_fit_the_gpu_beside_vllm() -> None:
    gib = 1 << 30
    fits = cuda.stage_verdict(0, 1 << 30, 79 * gib, 80 * gib)
    assert fits.status is Status.OK and "1024 MiB staging area" in fits.message and "78.0 GiB remain" in fits.message
    tight = cuda.stage_verdict(1, 8 * gib, 79 * gib, 80 * gib)  # 71 GiB left, vLLM's default wants 72
    assert tight.status is Status.WARN and "wants 72.0 GiB free" in tight.message
    assert tight.remedy == "lower --stage-mib, or start vLLM with --gpu-memory-utilization 0.88 or less"
    too_big = cuda.stage_verdict(0, 81 * gib, 79 * gib, 80 * gib)
    assert too_big.status is Status.FAIL and too_big.message.endswith("it does not fit")


def test_the_staging_area_check_runs_only_when_asked_and_only_for_gpus() -> None:
    assert cuda.check_stage_area(ctx_of(DoctorOptions(stage_bytes=1 << 30))).status is Status.SKIP
    from kvbm_client.doctor import ALL_CHECKS
    (stage,) = [c for c in ALL_CHECKS if c.id == "cuda.stage"]
    assert stage.option == "stage_bytes" and not DoctorOptions().stage_bytes


@no_gpu
def test_the_staging_area_check_without_cuda_fails_for_gpus() -> None:
    result = cuda.check_stage_area(ctx_of(DoctorOptions(gpus=(0,), stage_bytes=1 << 30)))
    assert result.status is Status.FAIL and "but --gpus asks for GPU workers" in result.message


@gpu
def test_the_staging_area_check_on_a_gpu() -> None:
    fits = cuda.check_stage_area(ctx_of(DoctorOptions(gpus=(0,), stage_bytes=1 << 30)))
    assert fits.status in (Status.OK, Status.WARN) and "cuda:0: a 1024 MiB staging area" in fits.message
    huge = cuda.check_stage_area(ctx_of(DoctorOptions(gpus=(0,), stage_bytes=1 << 50)))
    assert huge.status is Status.FAIL
