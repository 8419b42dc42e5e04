"""Put a CPU engine's KV cache in a sealed memfd the worker daemon can be handed.

vLLM (>= 0.32) allocates the whole KV cache as one ``torch.zeros(n, dtype=torch.int8)``
inside the connector's ``get_mem_pool_context()``; this mode redirects exactly that call to
a sealed memfd (:func:`kvbm_client.regions.sealed_memfd`: its size can never change, so the
daemon's mapping can never fault) mapped with ``torch.from_file("/proc/self/fd/N",
shared=True)``. The layer views vLLM builds on top are unchanged, so the engine's own forward
pass reads and writes the very pages the daemon copies. The fd itself is what the worker side
registers (over the region socket); no file name exists that another process could open.
"""
from __future__ import annotations

import logging
import os

import torch

from ...regions import sealed_memfd

log = logging.getLogger("kvbm.connector")


class ShmKvAllocation(torch.overrides.TorchFunctionMode):
    """Redirect the first large int8 ``torch.zeros`` (the KV buffer) to a sealed memfd."""

    def __init__(self, rank: int, min_bytes: int = 1 << 20) -> None:
        super().__init__()
        self.name = f"kvbm-vllm-kv-r{rank}"
        self.min_bytes = min_bytes
        self.fd = -1
        self.tensor: torch.Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.zeros and self.tensor is None and kwargs.get("dtype") is torch.int8
                and str(kwargs.get("device", "cpu")) == "cpu"):
            size = args[0] if args and isinstance(args[0], int) else (args[0][0] if args else None)
            if isinstance(size, int) and size >= self.min_bytes:
                self.fd = sealed_memfd(self.name, size)
                # NOTE: a fresh memfd reads as zeros, as torch.zeros would have filled it.
                self.tensor = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=size, dtype=torch.int8)
                log.info("kvbm: engine KV cache (%d bytes) placed in sealed memfd %d", size, self.fd)
                return self.tensor
        return func(*args, **kwargs)

    def close(self) -> None:
        """Close the fd (the mapping, and the daemon's, keep the memory while they exist)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
