"""Small, tested shims over the vLLM versions kvbm supports (0.26 on GPU, 0.32 CPU build).

Differences that matter here: 0.26 has no ``get_mem_pool_context`` (GPU engines export their
KV cache through CUDA IPC instead) and calls ``get_finished`` directly; 0.32 calls
``start_load_kv`` after the forward for asynchronous loads. The connector implements the
union of both hook sets. On the GPU, 0.26 asks ``prefer_cross_layer_blocks`` and then hands
one cross-layer buffer ``[num_blocks, num_layers, ...]`` to ``register_cross_layers_kv_cache``
(each block one 2+ MiB run); otherwise it calls ``register_kv_caches`` with one tensor per layer.
0.26 runs with asynchronous scheduling on the GPU: ``wait_for_save`` returns before the
forward has run, so stores wait on a CUDA event first (``worker.py``).
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvbm.connector")

SUPPORTED = ((0, 26), (0, 32))


def parse_version(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_version(version: str | None = None) -> bool:
    if version is None:
        import vllm
        version = getattr(vllm, "__version__", "0.0")
    ok = SUPPORTED[0] <= parse_version(version) <= SUPPORTED[1]
    if not ok:
        log.warning("kvbm connector is tested with vLLM %d.%d - %d.%d; this is %s", *SUPPORTED[0], *SUPPORTED[1],
                    version)
    return ok


def worker_rank(vllm_config) -> int:
    """The tensor-parallel rank of this worker process (0 without parallelism)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:
        return int(getattr(vllm_config.parallel_config, "rank", 0) or 0)


def tensor_parallel_size(vllm_config) -> int:
    """How many worker processes (one kvbm worker daemon each) serve this engine."""
    return max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))


def world_size(vllm_config) -> int:
    """The engine's worker processes, each with a worker role that reports every step."""
    return max(1, int(getattr(vllm_config.parallel_config, "world_size", 0) or tensor_parallel_size(vllm_config)))


def overlapping_steps(vllm_config) -> int:
    """How many engine steps run at once: 2 with asynchronous scheduling (a step is scheduled
    before the previous one's output, failed loads included, is known), else 1 (more with
    pipeline parallelism)."""
    value = getattr(vllm_config, "max_concurrent_batches", None)
    if isinstance(value, int) and value > 0:
        return value
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return 2 if getattr(scheduler, "async_scheduling", False) else 1


def defers_block_frees(vllm_config) -> bool:
    """vLLM returns a freed or preempted request's blocks to its pool only once the steps in
    flight that may still write them have run (``Scheduler.defer_block_free``, vllm#45357: with
    overlapping steps and a KV-consumer connector, as kvbm's ``kv_both``). Without it (a vLLM
    that predates it), a load into a block reallocated while the previous step still runs on
    the GPU is not ordered with that step's writes (issue 17 window 4)."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return False
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return hasattr(Scheduler, "_drain_deferred_frees") and bool(getattr(ktc, "is_kv_consumer", False))


def auto_load_mode(vllm_config) -> tuple[str, str]:
    """What ``load_mode: "auto"`` (the default) means on this engine: ``("sync" | "async", why)``.

    Synchronous loads are the fast path (the hit is in place in the step that computes the rest
    of the prompt: one engine step less per hit). But a synchronous load that fails is recomputed
    by the engine after the model runner has already seen the request with the hit counted as
    computed, and vLLM's V2 model runner (the default for most GPU models) rewinds only its CPU
    copy of ``num_computed_tokens`` then: the recompute reads tokens and positions from a stale
    device-side count, and under async scheduling the request also keeps its in-flight output
    placeholders, so its output is wrong (vllm#49250, open; fixes proposed in vllm#49252 and
    vllm#53298; measured in 0.26, and the same code is in 0.32's source). An asynchronous load fails while the request waits
    (``WAITING_FOR_REMOTE_KVS``), before the runner has seen it, and is recomputed correctly.

    vLLM 0.26's V1 runner under async scheduling fails too (measured, ``tests/stress`` on an
    H200: a gather index out of bounds kills the engine after "Recovered from KV load failure").

    So: synchronous only under the V1 model runner with one step at a time (the CPU build:
    no Triton, no async scheduling), asynchronous otherwise. NOTE: ``kv_load_failure_policy`` is not
    consulted: inside a ``MultiConnector`` a child's config carries vLLM's default ("fail")
    while the scheduler acts on the outer config's policy, so the child cannot know it.
    """
    try:
        v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
    except Exception:  # noqa: BLE001 - a config the property cannot judge: treat as V2 (the safe side)
        v2 = True
    risk = "vLLM's V2 model runner" if v2 else "async scheduling" if overlapping_steps(vllm_config) > 1 else ""
    if risk:
        return "async", (f"{risk} recomputes a failed synchronous load wrongly (vllm#49250); set load_mode "
                         "\"sync\" to take one engine step off each hit's TTFT at that risk")
    return "sync", "vLLM's V1 model runner, one step at a time, recomputes a failed synchronous load correctly"


def cuda_graph_modes(vllm_config) -> tuple[str, str]:
    """``(decode, mixed)``: the CUDA graph mode ("FULL", "PIECEWISE" or "NONE") vLLM runs a
    uniform decode batch in (every request's query one decode step: 1 + speculative tokens), and
    every other batch in. vLLM's default FULL_AND_PIECEWISE is ("FULL", "PIECEWISE"); eager and
    the CPU build are ("NONE", "NONE")."""
    mode: Any = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    try:
        return mode.decode_mode().name, mode.mixed_mode().name
    except AttributeError:  # no graphs, or a vLLM without the mode
        return "NONE", "NONE"


def layerwise_graph_fit(vllm_config) -> int | None:
    """The fewest prompt tokens a request with a layer-pipelined load must compute itself, or
    None where such loads cannot run.

    Their forward waits in vLLM's per-layer hooks, which the replay of a FULL CUDA graph skips
    (vllm#29608). vLLM runs FULL graphs only for a batch whose requests all have the same query
    length, that of one decode step (``1 + num_speculative_tokens``; V1 runner ``_is_uniform_decode``,
    V2 runner ``get_uniform_token_count``), and other batches in PIECEWISE graphs (the hooks run
    between the pieces) or eagerly. So a load whose request computes at least one token more than
    a decode step never runs in a FULL graph, and decode keeps its FULL graphs: declaring
    ``requires_piecewise_for_cudagraph`` instead made vLLM run every batch PIECEWISE, and decode
    took 10.0 ms a token against 5.5 (8 requests, H200, 2026-11-27). Where every batch runs FULL
    graphs (``cudagraph_mode`` FULL), the hooks never run: None."""
    decode, mixed = cuda_graph_modes(vllm_config)
    if mixed == "FULL":
        return None
    if decode != "FULL":
        return 1  # (the last prompt token, whose logits the engine needs)
    try:
        spec = int(getattr(vllm_config, "num_speculative_tokens", 0) or 0)
    except (TypeError, ValueError):
        spec = 0
    return 2 + spec


def block_page(shape, strides) -> int | None:
    """Elements of one block's page when dim 0 indexes blocks and each block's slice is one
    dense range (any order of the other dims: vLLM 0.26 FlashAttention per-layer views are
    logical (B, H, N, 2D) over physical (B, N, H, 2D)); None otherwise. Pure arithmetic."""
    if len(shape) < 2:
        return None
    dims = sorted(((int(st), int(sz)) for sz, st in zip(shape[1:], strides[1:]) if sz > 1))
    expected = 1
    for st, sz in dims:
        if st != expected:
            return None
        expected *= sz
    if int(shape[0]) > 1 and int(strides[0]) < expected:
        return None
    return expected


def block_pages(tensor):
    """A ``[num_blocks, page]`` view of a KV tensor whose blocks are dense (see :func:`block_page`)."""
    page = block_page(tuple(tensor.shape), tuple(tensor.stride()))
    if page is None:
        raise ValueError(f"KV tensor {tuple(tensor.shape)} strides {tuple(tensor.stride())}: a block is "
                         "not one dense range")
    return tensor.as_strided((tensor.shape[0], page), (tensor.stride(0), 1), tensor.storage_offset())


def _tensor_key(t) -> tuple:
    """Tensors with equal keys are one tensor of the region (exported once)."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()))


def names_by_tensor(kv_caches: dict) -> list[list[str]]:
    """vLLM's layer names grouped by the tensor they use, in :func:`gpu_region_spec`'s order."""
    order: dict[tuple, list[str]] = {}
    for name, t in kv_caches.items():
        order.setdefault(_tensor_key(t), []).append(name)
    return list(order.values())


def cross_layer_names(kv_cache_config) -> list[list[str]]:
    """The layer names of each index of vLLM's cross-layer buffer (its ``num_layers`` dim
    follows ``kv_cache_config.kv_cache_tensors``; []: unknown). They map to pages only when the
    buffer is exported one page per layer (:func:`gpu_region_spec`'s ``layer_pages``)."""
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None) or []
    return [list(getattr(t, "shared_by", []) or []) for t in tensors]


def layers_follow_blocks(attn_backend) -> bool:
    """Whether vLLM's cross-layer buffer for ``attn_backend`` is laid out ``[blocks, layers, ...]``
    in memory: vLLM prepends the layers dim (logical dim 0) and permutes by the backend's stride
    order, so physical dim 1 is the layers dim only where that order's second entry is 0 (an HND
    layout puts the heads there; with as many heads as layers the shapes alone cannot tell)."""
    try:
        order = tuple(attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
    except (AttributeError, NotImplementedError, TypeError):
        return False
    return len(order) >= 2 and order[1] == 0


def check_block_count(num_blocks: int, kv_cache_config) -> None:
    """Raise ValueError when the exported KV cache's blocks are not vLLM's blocks (a kernel block
    smaller than vLLM's: block ids would address the wrong memory)."""
    expected = getattr(kv_cache_config, "num_blocks", None)
    if isinstance(expected, int) and expected > 0 and num_blocks != expected:
        raise ValueError(f"the KV cache has {num_blocks} blocks where vLLM allocates {expected} "
                         "(kernel blocks smaller than vLLM's blocks are not supported)")


def per_layer_pages(tensor, layers: int):
    """A cross-layer buffer ``[num_blocks, layers, ...]`` as ``[num_blocks, layers, page]``: one
    page per layer (each layer's part of a block dense, layers outermost); None when it is not
    laid out so."""
    if layers <= 1 or tensor.dim() < 3 or tensor.shape[1] != layers:
        return None
    whole = block_page(tuple(tensor.shape), tuple(tensor.stride()))
    per = whole // layers if whole is not None and whole % layers == 0 else 0
    if not per or tensor.stride(1) != per:
        return None
    return tensor.as_strided((tensor.shape[0], layers, per), (tensor.stride(0), per, 1), tensor.storage_offset())


def gpu_region_spec(tensors, layer_pages: int = 0):
    """The CUDA IPC export of a GPU engine's KV cache: one tensor (vLLM 0.26 cross-layer buffer,
    ``register_cross_layers_kv_cache``) or one per layer (``register_kv_caches``); layers that
    share a tensor are exported once. ``layer_pages``: the cross-layer buffer's layers, to export
    it one page per layer (layer-pipelined loads copy a block's pages in layer groups; the slot
    bytes are the same, and the daemon merges adjacent pages into one DMA); 0: a page per block."""
    from ...cuda_export import export_kv_cache
    unique, seen = [], set()
    for t in tensors:
        key = _tensor_key(t)
        if key not in seen:
            seen.add(key)
            split = per_layer_pages(t, layer_pages) if len(tensors) == 1 and layer_pages > 1 else None
            unique.append(split if split is not None else block_pages(t))
    return export_kv_cache(unique, block_dim=0, page_dims=1)


def is_cuda(vllm_config) -> bool:
    device = str(getattr(getattr(vllm_config, "device_config", None), "device", "cpu"))
    return device.startswith("cuda")


def kv_cache_layout(vllm_config: Any) -> str:
    """The engine's KV cache layout (``NHD``, ``HND``, …): the byte order inside a page, so
    it is part of kvbm's namespace (a NIXL prefill engine runs HND beside NHD engines). vLLM
    0.32 resolves it in the engine core before the scheduler exists
    (``cache_config.kv_cache_layout``); 0.26 answers through a global function."""
    layout = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    if layout:
        return str(getattr(layout, "name", layout))
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout  # vLLM 0.26
        return str(get_kv_cache_layout())
    except Exception:  # noqa: BLE001 - any vLLM that cannot say: one shared default name
        return "default"


def namespace(vllm_config: Any) -> str:
    """What must be equal for two engines' blocks to be the same bytes: the model, its dtype,
    the KV cache dtype (fp8 KV differs from bf16), the page layout and the block size."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    return (f"{model.model}|{model.dtype}|kv={getattr(cache, 'cache_dtype', 'auto')}|"
            f"{kv_cache_layout(vllm_config)}|{cache.block_size}")


def kv_cache_groups(kv_cache_config: Any) -> int:
    """How many KV cache groups the engine has (hybrid models: more than one; 0: not known)."""
    return len(getattr(kv_cache_config, "kv_cache_groups", None) or ())
