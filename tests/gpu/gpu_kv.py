"""KV cache layouts of a vLLM-like engine on the GPU, and their reference bytes."""
from __future__ import annotations

import torch

from kvbm_client.cuda_export import page_placements


def make_kv(layout: str, num_blocks: int, layers: int, tokens: int = 16, heads: int = 2, dim: int = 64,
            dtype=torch.bfloat16):
    """``cross``: one [num_blocks, layers, 2, tokens, heads, dim] tensor (vLLM cross-layer);
    ``layers``: one [2, num_blocks, tokens, heads, dim] tensor per layer (FlashAttention)."""
    if layout == "cross":
        return torch.empty(num_blocks, layers, 2, tokens, heads, dim, dtype=dtype, device="cuda")
    return [torch.empty(2, num_blocks, tokens, heads, dim, dtype=dtype, device="cuda") for _ in range(layers)]


def block_dim(layout: str) -> int:
    return 0 if layout == "cross" else 1


def tensors(kv) -> list:
    return [kv] if isinstance(kv, torch.Tensor) else list(kv)


def fill_random(kv, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    for t in tensors(kv):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, device="cuda",
                                                dtype=torch.uint8))
    torch.cuda.synchronize()


def block_bytes(kv, layout: str, block: int) -> torch.Tensor:
    """Reference content of one block in slot layout (layer0.K, layer0.V, layer1.K, ...)."""
    if layout == "cross":
        return kv[block].reshape(-1).view(torch.uint8)
    return torch.cat([t[k, block].reshape(-1).view(torch.uint8) for t in kv for k in range(2)])


def local_region(kv, layout: str):
    """A CudaEngineRegion over this process's own tensors (IPC cannot reopen our own handle)."""
    from kvbm_worker.cuda_region import CudaEngineRegion
    ts = tensors(kv)
    layers = []
    for i, t in enumerate(ts):
        n, page, pages = page_placements(t.shape, t.stride(), t.element_size(), 0, block_dim(layout), 3)
        layers += [(i, off, st) for off, st in pages]
    return CudaEngineRegion.from_local(ts, layers, page, n)
