"""Put a CPU engine's KV cache in a shared-memory file the worker daemon can map.

vLLM (>= 0.32) allocates the whole KV cache as one ``torch.zeros(n, dtype=torch.int8)``
inside the connector's ``get_mem_pool_context()``; this mode redirects exactly that call to
``torch.from_file(path, shared=True)``. The layer views vLLM builds on top are unchanged, so
the engine's own forward pass reads and writes the very pages the daemon copies.
"""
from __future__ import annotations

import logging
import os

import torch

from ...procs import remove_stale_files

log = logging.getLogger("kvbm.connector")

SHM_DIR = "/dev/shm"
PREFIX = "kvbm-vllm-kv-"


class ShmKvAllocation(torch.overrides.TorchFunctionMode):
    """Redirect the first large int8 ``torch.zeros`` (the KV buffer) to a /dev/shm file."""

    def __init__(self, rank: int, directory: str = SHM_DIR, min_bytes: int = 1 << 20) -> None:
        super().__init__()
        self.path = os.path.join(directory, f"{PREFIX}{os.getpid()}-r{rank}")
        self.min_bytes = min_bytes
        self.tensor: torch.Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.zeros and self.tensor is None and kwargs.get("dtype") is torch.int8
                and str(kwargs.get("device", "cpu")) == "cpu"):
            size = args[0] if args and isinstance(args[0], int) else (args[0][0] if args else None)
            if isinstance(size, int) and size >= self.min_bytes:
                remove_stale_files(os.path.dirname(self.path), PREFIX)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.ftruncate(fd, size)
                finally:
                    os.close(fd)
                self.tensor = torch.from_file(self.path, shared=True, size=size, dtype=torch.int8)
                log.info("kvbm: engine KV cache (%d bytes) placed in %s", size, self.path)
                return self.tensor
        return func(*args, **kwargs)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


