"""Whether this machine can run the GPU tests (imports nothing CUDA at module level)."""
from __future__ import annotations

#: Seconds for a GPU worker to attach: it imports torch and creates its CUDA context first.
GPU_READY_TIMEOUT = 120.0


def cuda_ready() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from kvbm_worker.cuda_region import cudart
        cudart()
    except ImportError:
        return "cuda-python is not installed"
    return None
