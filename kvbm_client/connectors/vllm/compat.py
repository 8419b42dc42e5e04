"""Small, tested shims over the vLLM versions kvbm supports (0.26 on GPU, 0.32 CPU build).

Differences that matter here: 0.26 has no ``get_mem_pool_context`` (GPU engines export their
KV cache through CUDA IPC instead) and calls ``get_finished`` directly; 0.32 calls
``start_load_kv`` after the forward for asynchronous loads. The connector implements the
union of both hook sets.
"""
from __future__ import annotations

import logging

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


def is_cuda(vllm_config) -> bool:
    device = str(getattr(getattr(vllm_config, "device_config", None), "device", "cpu"))
    return device.startswith("cuda")
