"""The direct CUDA calls' loading and refusals, on a machine without a GPU: the runtime library
from the nvidia-cuda-runtime wheel loads, its version picks the batch call's signature, and a
call that cannot run raises a named error instead of copying anything. (The bytes they move
are checked on a GPU: ``tests/gpu/test_cuda_copier.py``, mechanism ``direct``.)"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

import numpy as np
import pytest

from kvbm_worker.handlers import cudart_direct


def _wheel_cudart() -> str | None:
    for root in sys.path:
        for path in sorted(glob.glob(os.path.join(root, "nvidia", "cu1*", "lib", "libcudart.so.1*"))):
            return path
    return None


def test_the_mapped_runtime_is_read_from_the_process_maps(tmp_path, monkeypatch):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42   /usr/lib/libc.so.6\n"
                    "7f02-7f03 r--p 00000000 00:00 0 \n"
                    "7f04-7f05 r-xp 00000000 08:01 43   /opt/x/nvidia/cu13/lib/libcudart.so.13\n")
    monkeypatch.setattr(cudart_direct, "MAPS", maps)
    assert cudart_direct._mapped_cudart() == "/opt/x/nvidia/cu13/lib/libcudart.so.13"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42   /usr/lib/libc.so.6\n")
    assert cudart_direct._mapped_cudart() is None
    assert cudart_direct.load() is None  # nothing mapped: the copier keeps cuda-python
    monkeypatch.setattr(cudart_direct, "MAPS", tmp_path / "absent")
    assert cudart_direct._mapped_cudart() is None


def test_a_library_without_the_runtime_is_refused(tmp_path, monkeypatch):
    libc = ctypes.util.find_library("c")
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42   /nowhere/libcudart.so.13\n")
    monkeypatch.setattr(cudart_direct, "MAPS", maps)
    assert cudart_direct.load() is None  # (cannot be opened: logged, cuda-python stays)
    with pytest.raises((OSError, AttributeError)):
        cudart_direct.Direct(libc or "libc.so.6")  # no cudaRuntimeGetVersion


@pytest.mark.skipif(_wheel_cudart() is None, reason="no nvidia-cuda-runtime wheel in this environment")
def test_without_a_gpu_a_batch_raises_a_named_error():
    direct = cudart_direct.Direct(_wheel_cudart())
    assert direct.version >= 12080
    n = 4
    with pytest.raises(cudart_direct.DirectError, match=r"cudaMemcpyBatchAsync \(4 copies\): cudaError"):
        direct.batch(np.arange(n, dtype=np.int64) * 4096 + (1 << 40), np.arange(n, dtype=np.int64) * 4096 + (1 << 41),
                     np.full(n, 4096, np.int64), 0)
    with pytest.raises(cudart_direct.DirectError, match="cudaEventCreateWithFlags"):
        direct.event()
