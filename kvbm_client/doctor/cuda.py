"""Checks of CUDA: devices and the torch build, G2 pinning, CUDA IPC between processes, and
(``--bench-h2d``) pinned H2D bandwidth.

Runs in ``kvbm doctor``. The probes use cuda-python, the runtime the GPU worker drives
(``cudaHostRegister`` on anonymous memory for G2, ``cudaIpcOpenMemHandle`` in another process
for the engine's KV cache), and never import torch.
NOTE: importing torch took 4.7 s on an H100 node, more than every other check together; the
torch build is read from ``torch/version.py`` instead (a CPU-only wheel, or a CUDA newer than
the driver, is what makes the worker's ``torch.cuda.is_available()`` fail).
"""
from __future__ import annotations

import ast
import ctypes
import hashlib
import importlib.util
import mmap
import os
import subprocess
import sys
import time

import numpy as np

from .base import Check, CheckResult, DoctorContext, Status, fail, info, ok, skip, warn
from .cudart import CudaCallError, check, runtime

DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia/version")
PIN_BYTES = 64 << 20
IPC_BYTES = 16 << 20
IPC_HANDLE_BYTES = 64
IPC_CHILD_TIMEOUT_S = 60.0
BENCH_BYTES = 256 << 20
BENCH_SECONDS = 1.0
#: vLLM's default ``gpu_memory_utilization``: the share of a GPU's memory vLLM wants free at its start
VLLM_GPU_MEMORY_UTILIZATION = 0.9


def _device(ctx: DoctorContext) -> int:
    return ctx.options.gpus[0] if ctx.options.gpus else 0


def _no_cuda(ctx: DoctorContext, why: str) -> CheckResult:
    """No CUDA is a skip on a CPU node, a failure where --gpus asks for GPU workers."""
    if ctx.options.gpus:
        return fail(f"no CUDA: {why}, but --gpus asks for GPU workers",
                    "install the NVIDIA driver and cuda-python (and a CUDA build of torch), or run CPU workers")
    return skip(f"no CUDA: {why}")


def load_runtime(ctx: DoctorContext):
    """``(cuda runtime, device count, None)`` when a device is usable, else ``(None, 0, result)``."""
    if not any(os.path.exists(p) for p in DRIVER_FILES):
        return None, 0, _no_cuda(ctx, "no NVIDIA driver (/dev/nvidiactl absent)")
    try:
        rt = runtime()
    except ImportError:
        return None, 0, _no_cuda(ctx, "cuda-python is not installed (the GPU worker needs it)")
    err, count = rt.cudaGetDeviceCount()
    if err != rt.cudaError_t.cudaSuccess or count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return None, 0, _no_cuda(ctx, f"no device visible{where}: {getattr(err, 'name', err)}")
    return rt, count, None


def torch_build() -> tuple[str, str | None] | None:
    """``(version, CUDA version or None)`` of the installed torch, read without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    values: dict[str, object] = {}
    try:
        with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value
    return str(values.get("__version__", "?")), values.get("cuda")  # type: ignore[return-value]


def _torch_problem(driver: int) -> str:
    """Why the GPU worker's torch cannot use CUDA with this driver ("" when it can)."""
    build = torch_build()
    if build is None:
        return "torch is not installed (the GPU worker needs it)"
    version, cuda = build
    if not cuda:
        return f"torch {version} is a CPU-only build"
    major, minor = (int(x) for x in cuda.split(".")[:2])
    if major * 1000 + minor * 10 > driver:
        return f"torch {version} needs CUDA {cuda}, the driver supports {driver // 1000}.{driver % 1000 // 10}"
    return ""


def check_devices(ctx: DoctorContext) -> CheckResult:
    """Every GPU given with --gpus is visible, and torch's CUDA build suits the driver."""
    rt, count, result = load_runtime(ctx)
    if rt is None:
        return result
    driver = int(check(rt.cudaDriverGetVersion(), "cudaDriverGetVersion"))
    names = []
    for d in range(count):
        props = check(rt.cudaGetDeviceProperties(d), "cudaGetDeviceProperties")
        name = props.name.decode(errors="replace").rstrip("\0") if isinstance(props.name, bytes) else props.name
        names.append(f"{d}: {name} {props.totalGlobalMem / 2**30:.0f} GiB")
    build = torch_build()
    text = (f"{count} device(s), driver CUDA {driver // 1000}.{driver % 1000 // 10}, "
            f"torch {build[0] if build else 'absent'}: {'; '.join(names)}")
    missing = [d for d in ctx.options.gpus if not 0 <= d < count]
    if missing:
        return fail(f"{text}; --gpus {','.join(map(str, missing))} not visible",
                    "check CUDA_VISIBLE_DEVICES and nvidia-smi; device ordinals start at 0", devices=count)
    problem = _torch_problem(driver)
    if problem and ctx.options.gpus:
        return fail(f"{text}; {problem}", "install a torch wheel built for this driver's CUDA "
                    "(https://pytorch.org/get-started/locally/) or update the driver", devices=count)
    return ok(text + (f" ({problem})" if problem else ""), devices=count)


def _pattern(nbytes: int) -> np.ndarray:
    """Known bytes with a prime period, so a page copied to the wrong place shows."""
    period = np.random.default_rng(7).integers(0, 256, 4099, dtype=np.uint8)
    return np.tile(period, nbytes // 4099 + 1)[:nbytes]


def check_pinned(ctx: DoctorContext) -> CheckResult:
    """``cudaHostRegister`` pins anonymous memory (as the worker pins G2) and DMA round-trips it."""
    rt, _count, result = load_runtime(ctx)
    if rt is None:
        return result
    device = _device(ctx)
    buf = mmap.mmap(-1, PIN_BYTES, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    host = np.frombuffer(buf, dtype=np.uint8)
    host[:] = _pattern(PIN_BYTES)
    back = np.zeros(PIN_BYTES, dtype=np.uint8)
    check(rt.cudaSetDevice(device), "cudaSetDevice")
    start = time.perf_counter()
    try:
        check(rt.cudaHostRegister(host.ctypes.data, PIN_BYTES, 0), "cudaHostRegister")
    except CudaCallError as exc:
        return fail(f"pinning {PIN_BYTES >> 20} MiB failed: {exc}", "check dmesg and the container's memory limits")
    pin_ms = (time.perf_counter() - start) * 1e3
    dev = 0
    try:
        dev = check(rt.cudaMalloc(PIN_BYTES), "cudaMalloc")
        check(rt.cudaMemcpy(dev, host.ctypes.data, PIN_BYTES, rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "H2D")
        check(rt.cudaMemcpy(back.ctypes.data, dev, PIN_BYTES, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost), "D2H")
    finally:
        if dev:
            rt.cudaFree(dev)
        rt.cudaHostUnregister(host.ctypes.data)
        del host
    if not np.array_equal(back, _pattern(PIN_BYTES)):
        return fail("pinned memory came back from the GPU with other bytes", "check the GPU (nvidia-smi -q, dmesg Xid)")
    return ok(f"pinned {PIN_BYTES >> 20} MiB with cudaHostRegister in {pin_ms:.1f} ms, GPU {device} round trip exact",
              pin_ms=round(pin_ms, 2))


def _run_child(device: int, handle: bytes, expected: str) -> CheckResult | None:
    """The importing process; None when it read ``expected`` (a SHA-256), else the failure."""
    argv = [sys.executable, "-m", "kvbm_client.doctor.ipc_child", str(device), handle.hex(), "0", str(IPC_BYTES)]
    try:
        child = subprocess.run(argv, capture_output=True, text=True, timeout=IPC_CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return fail(f"the importing process did not finish in {IPC_CHILD_TIMEOUT_S:g} s",
                    "check the GPU (nvidia-smi) and that nothing holds it exclusively")
    answer = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    if child.returncode == 0 and answer == expected:
        return None
    detail = (child.stderr.strip().splitlines() or [answer or "no output"])[-1]
    return fail(f"CUDA IPC import in a second process failed: {detail}",
                "engine and worker must share the GPU and the IPC namespace (containers: --ipc=host, the "
                "same CUDA_VISIBLE_DEVICES)")


def check_ipc(ctx: DoctorContext) -> CheckResult:
    """An allocation exported with ``cudaIpcGetMemHandle`` opens in another process (as the worker
    opens the engine's KV cache) and reads the same bytes."""
    rt, _count, result = load_runtime(ctx)
    if rt is None:
        return result
    device = _device(ctx)
    data = _pattern(IPC_BYTES)
    check(rt.cudaSetDevice(device), "cudaSetDevice")
    dev = check(rt.cudaMalloc(IPC_BYTES), "cudaMalloc")
    try:
        check(rt.cudaMemcpy(dev, data.ctypes.data, IPC_BYTES, rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "H2D")
        handle = check(rt.cudaIpcGetMemHandle(dev), "cudaIpcGetMemHandle")
        failure = _run_child(device, ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES),
                             hashlib.sha256(data.tobytes()).hexdigest())
    except CudaCallError as exc:
        failure = fail(f"exporting a CUDA IPC handle failed: {exc}", "check the driver (nvidia-smi) and dmesg")
    finally:
        rt.cudaFree(dev)
    return failure or ok(f"{IPC_BYTES >> 20} MiB exported on GPU {device}, opened by another process, same bytes")


def check_bench_h2d(ctx: DoctorContext) -> CheckResult:
    """``--bench-h2d``: pinned host -> device bandwidth for about a second."""
    rt, _count, result = load_runtime(ctx)
    if rt is None:
        return result
    check(rt.cudaSetDevice(_device(ctx)), "cudaSetDevice")
    src = check(rt.cudaMallocHost(BENCH_BYTES), "cudaMallocHost")
    dst = check(rt.cudaMalloc(BENCH_BYTES), "cudaMalloc")
    stream = check(rt.cudaStreamCreate(), "cudaStreamCreate")
    h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
    try:
        check(rt.cudaMemcpy(dst, src, BENCH_BYTES, h2d), "H2D")  # warm-up
        copies, start = 0, time.perf_counter()
        while time.perf_counter() - start < BENCH_SECONDS:
            for _ in range(4):
                check(rt.cudaMemcpyAsync(dst, src, BENCH_BYTES, h2d, stream), "H2D")
            check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
            copies += 4
        gbps = copies * BENCH_BYTES / (time.perf_counter() - start) / 1e9
    finally:
        rt.cudaStreamDestroy(stream)
        rt.cudaFree(dst)
        rt.cudaFreeHost(src)
    return info(f"pinned H2D {gbps:.1f} GB/s ({copies} copies of {BENCH_BYTES >> 20} MiB)", h2d_gbps=round(gbps, 2))


def stage_verdict(device: int, area: int, free: int, total: int,
                  utilization: float = VLLM_GPU_MEMORY_UTILIZATION) -> CheckResult:
    """Whether a worker's staging area of ``area`` bytes fits GPU ``device`` (``free`` of ``total``
    bytes free now), and leaves vLLM the free memory it wants at its start (``utilization`` × total)."""
    gib = 1 << 30
    left, wanted = free - area, utilization * total
    text = (f"cuda:{device}: a {area / (1 << 20):g} MiB staging area, {free / gib:.1f} of {total / gib:.1f} GiB free")
    data = {"device": device, "area_bytes": area, "free_bytes": free, "total_bytes": total}
    if left < 0:
        return fail(f"{text}: it does not fit", "give a smaller --stage-mib (or 0: none), or free the GPU", **data)
    if left < wanted:
        most = int(left / total * 100) / 100
        return warn(f"{text}: {left / gib:.1f} GiB would remain, and vLLM at gpu_memory_utilization {utilization:g} "
                    f"wants {wanted / gib:.1f} GiB free at its start",
                    f"lower --stage-mib, or start vLLM with --gpu-memory-utilization {most:.2f} or less", **data)
    return ok(f"{text}; {left / gib:.1f} GiB remain (vLLM at gpu_memory_utilization {utilization:g} wants "
              f"{wanted / gib:.1f})", **data)


def check_stage_area(ctx: DoctorContext) -> CheckResult:
    """``--stage-mib`` with ``--gpus``: the area fits each GPU beside vLLM (:func:`stage_verdict`;
    the worst device's verdict)."""
    if not ctx.options.gpus:
        return skip("no --gpus: a CPU worker's staging area is host memory")
    rt, _count, result = load_runtime(ctx)
    if rt is None:
        return result
    verdicts = []
    for device in ctx.options.gpus:
        check(rt.cudaSetDevice(device), "cudaSetDevice")
        free, total = check(rt.cudaMemGetInfo(), "cudaMemGetInfo")
        verdicts.append(stage_verdict(device, ctx.options.stage_bytes, int(free), int(total)))
    worst = (Status.OK, Status.WARN, Status.FAIL)
    return max(verdicts, key=lambda r: worst.index(r.status))


CHECKS = (
    Check("cuda", "devices", check_devices, needs_config=False),
    Check("cuda", "pinned", check_pinned, needs_config=False),
    Check("cuda", "ipc", check_ipc, needs_config=False),
    Check("cuda", "bench_h2d", check_bench_h2d, needs_config=False, option="bench_h2d"),
    Check("cuda", "stage", check_stage_area, needs_config=False, option="stage_bytes"),
)
