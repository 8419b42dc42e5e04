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


@pytest.mark.parametrize("release", [False, True])
def test_a_batch_is_cut_into_calls_of_at_most_batch_max_copies_in_order(release):
    """A stand-in for the foreign call (no CUDA): each call's count and first source address."""
    direct = cudart_direct.Direct.__new__(cudart_direct.Direct)
    calls: list[tuple[str, int, int]] = []

    def call(name):
        def record(dst, src, lengths, count, *rest):
            calls.append((name, count, ctypes.cast(src, ctypes.POINTER(ctypes.c_uint64))[0]))
            return 0
        return record
    direct._batch, direct._batch_free = call("held"), call("free")
    direct.version, direct._attr = 13000, cudart_direct.MemcpyAttributes()
    direct._attr_idx = (ctypes.c_size_t * 1)(0)
    n, cap = 2 * cudart_direct.BATCH_MAX + 7, cudart_direct.BATCH_MAX
    src = np.arange(n, dtype=np.int64) * 16
    direct.batch(src + 1, src, np.full(n, 16, np.int64), 0, release=release)
    name = "free" if release else "held"
    assert calls == [(name, cap, 0), (name, cap, cap * 16), (name, 7, 2 * cap * 16)]
