"""Checks of CUDA: devices visible, G2 pinning, CUDA IPC between processes, H2D bandwidth.

Runs in ``kvbm doctor``. torch is imported only when an NVIDIA driver is present, so a CPU
node answers "no CUDA" at once. The probes do what the GPU path does: the worker pins G2 with
``cudaHostRegister`` on anonymous memory; the engine exports its KV cache with
:func:`kvbm_client.cuda_export.export_kv_cache` and a *separate process* (the worker's side,
here :mod:`kvbm_client.doctor.ipc_child`) opens the handle with cuda-python.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import subprocess
import sys
import time

from ..cuda_export import export_kv_cache
from .base import Check, CheckResult, DoctorContext, fail, info, ok, skip

DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia/version")
PIN_BYTES = 64 << 20
IPC_BYTES = 16 << 20
IPC_CHILD_TIMEOUT_S = 60.0
BENCH_BYTES = 256 << 20
BENCH_SECONDS = 1.0


def _device(ctx: DoctorContext) -> int:
    return ctx.options.gpus[0] if ctx.options.gpus else 0


def _no_cuda(ctx: DoctorContext, why: str) -> CheckResult:
    """No CUDA is a skip on a CPU node, a failure where --gpus asks for GPU workers."""
    if ctx.options.gpus:
        return fail(f"no CUDA: {why}, but --gpus asks for GPU workers",
                    "install the NVIDIA driver and a CUDA build of torch, or run CPU workers")
    return skip(f"no CUDA: {why}")


def load_torch(ctx: DoctorContext):
    """``(torch, None)`` when CUDA is usable, else ``(None, the result to report)``."""
    if not any(os.path.exists(p) for p in DRIVER_FILES):
        return None, _no_cuda(ctx, "no NVIDIA driver (/dev/nvidiactl absent)")
    try:
        import torch
    except ImportError:
        return None, _no_cuda(ctx, "torch is not installed")
    if not torch.cuda.is_available():
        return None, _no_cuda(ctx, f"torch {torch.__version__} sees no CUDA device")
    return torch, None


def check_devices(ctx: DoctorContext) -> CheckResult:
    """Every GPU given with --gpus is visible (names, memory, driver's CUDA version)."""
    torch, result = load_torch(ctx)
    if torch is None:
        return result
    count = torch.cuda.device_count()
    names = []
    for d in range(count):
        props = torch.cuda.get_device_properties(d)
        names.append(f"{d}: {props.name} {props.total_memory / 2**30:.0f} GiB")
    text = f"{count} device(s), torch {torch.__version__} (CUDA {torch.version.cuda}): {'; '.join(names)}"
    missing = [d for d in ctx.options.gpus if not 0 <= d < count]
    if missing:
        return fail(f"{text}; --gpus {','.join(map(str, missing))} not visible",
                    "check CUDA_VISIBLE_DEVICES and nvidia-smi; device ordinals start at 0", devices=count)
    return ok(text, devices=count)


def check_pinned(ctx: DoctorContext) -> CheckResult:
    """``cudaHostRegister`` pins anonymous memory (as the worker pins G2) and DMA round-trips it."""
    torch, result = load_torch(ctx)
    if torch is None:
        return result
    device = _device(ctx)
    buf = mmap.mmap(-1, PIN_BYTES, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    host = torch.frombuffer(buf, dtype=torch.uint8)
    host.copy_(torch.randint(0, 256, (PIN_BYTES,), dtype=torch.uint8))
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    err = cudart.cudaHostRegister(host.data_ptr(), PIN_BYTES, 0)
    if int(err) != 0:
        return fail(f"cudaHostRegister of {PIN_BYTES >> 20} MiB failed: {err}",
                    "check `ulimit -l`, the container's memlock limit and dmesg")
    try:
        pin_s = time.perf_counter() - start
        dev = host.to(f"cuda:{device}", non_blocking=True)
        back = dev.cpu()
        torch.cuda.synchronize(device)
        same = bool(torch.equal(back, host))
    finally:
        cudart.cudaHostUnregister(host.data_ptr())
        del host
    if not same:
        return fail("pinned memory came back from the GPU with other bytes", "check the GPU (nvidia-smi -q, dmesg Xid)")
    return ok(f"pinned {PIN_BYTES >> 20} MiB with cudaHostRegister in {pin_s * 1e3:.1f} ms, "
              f"GPU {device} round trip exact", pin_ms=round(pin_s * 1e3, 2))


def check_ipc(ctx: DoctorContext) -> CheckResult:
    """The engine's CUDA IPC export opens in another process (the worker) and reads the same bytes."""
    torch, result = load_torch(ctx)
    if torch is None:
        return result
    device = _device(ctx)
    pages = torch.randint(0, 256, (IPC_BYTES,), dtype=torch.uint8, device=f"cuda:{device}")
    torch.cuda.synchronize(device)
    try:
        spec = export_kv_cache(pages.view(IPC_BYTES >> 16, 1, 1, 1 << 16), block_dim=0, page_dims=1)
    except ValueError as exc:
        return fail(f"the engine-side export failed: {exc}", "unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments")
    buf = spec.buffers[0]
    expected = hashlib.sha256(pages.cpu().numpy().tobytes()).hexdigest()
    argv = [sys.executable, "-m", "kvbm_client.doctor.ipc_child", str(buf.device), buf.ipc_handle.hex(),
            str(buf.offset_bytes), str(IPC_BYTES)]
    try:
        child = subprocess.run(argv, capture_output=True, text=True, timeout=IPC_CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return fail(f"the importing process did not finish in {IPC_CHILD_TIMEOUT_S:g} s",
                    "check the GPU (nvidia-smi) and that nothing holds it exclusively")
    finally:
        del pages
    answer = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    if child.returncode != 0 or answer != expected:
        detail = (child.stderr.strip().splitlines() or [answer or "no output"])[-1]
        return fail(f"CUDA IPC import in a second process failed: {detail}",
                    "engine and worker must share the GPU and the IPC namespace (containers: --ipc=host, "
                    "same CUDA_VISIBLE_DEVICES); no expandable_segments in PYTORCH_CUDA_ALLOC_CONF")
    return ok(f"{IPC_BYTES >> 20} MiB exported on GPU {device}, opened by another process, same bytes")


def check_bench_h2d(ctx: DoctorContext) -> CheckResult:
    """``--bench-h2d``: pinned host -> device bandwidth for about a second."""
    torch, result = load_torch(ctx)
    if torch is None:
        return result
    device = f"cuda:{_device(ctx)}"
    src = torch.empty(BENCH_BYTES, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(BENCH_BYTES, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize(device)
    copies, start = 0, time.perf_counter()
    while time.perf_counter() - start < BENCH_SECONDS:
        for _ in range(4):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        copies += 4
    gbps = copies * BENCH_BYTES / (time.perf_counter() - start) / 1e9
    return info(f"pinned H2D {gbps:.1f} GB/s ({copies} copies of {BENCH_BYTES >> 20} MiB)", h2d_gbps=round(gbps, 2))


CHECKS = (
    Check("cuda", "devices", check_devices, needs_config=False),
    Check("cuda", "pinned", check_pinned, needs_config=False),
    Check("cuda", "ipc", check_ipc, needs_config=False),
    Check("cuda", "bench_h2d", check_bench_h2d, needs_config=False, option="bench_h2d"),
)
