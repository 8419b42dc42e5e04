"""cuda-python's runtime for the doctor's CUDA probes, imported lazily.

Runs in ``kvbm doctor`` and in its IPC child. The same two helpers as the GPU worker's
(``kvbm_worker/cuda_region.py``), which kvbm_client may not import.
"""
from __future__ import annotations


class CudaCallError(RuntimeError):
    """A CUDA runtime call returned an error."""


def runtime():
    """``cuda.bindings.runtime`` (or ``cuda.cudart`` before cuda-python 12.6); ImportError if absent."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        from cuda import cudart as rt  # type: ignore[no-redef]
    return rt


def check(result, what: str):
    """Unpack a cuda-python ``(err, *values)`` tuple; raise :class:`CudaCallError` on failure."""
    rt = runtime()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        raise CudaCallError(f"{what}: {getattr(err, 'name', err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values
