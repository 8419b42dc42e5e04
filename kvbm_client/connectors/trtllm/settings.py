"""Settings of the TensorRT-LLM connector, read from the LLM API arguments and the environment.

Both roles build their classes from ``llm_args`` alone (TensorRT-LLM constructs them with
nothing else), so everything comes from there and from the environment:

* ``llm_args.kv_cache_config.tokens_per_block`` is the block size;
  ``llm_args.parallel_config.to_mapping()`` gives this process's rank and the world size
  (one kvbm worker daemon per rank, worker id = rank);
* ``DYN_KVBM_*`` (the node's socket dir, leader address, TLS, tokens) as for ``kvbm serve``;
* :data:`CONFIG_ENV`, a JSON object with the keys vLLM's ``kv_connector_extra_config`` takes
  (``socket_dir``, ``leader_address``, ``worker_address``, ``worker_id``, ``namespace``,
  ``timeout_s``, ``retry_s``, ``load_mode``, ``early_loads``), because TensorRT-LLM's
  ``kv_connector_config`` is a strict model with the module and class names only. ``load_mode``
  "auto" (the default) is "sync" here: the failed-load recompute that makes the vLLM connector
  choose "async" (vllm#49250) is vLLM's; TensorRT-LLM's own recompute of a failed load is
  untested here (its engine runs as stand-ins only). "layerwise" is refused: its per-layer
  waits are the vLLM connector's.

Pure: no I/O beyond reading the environment.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from ...ids import WorkerId
from ..core.settings import ConnectorSettings, LoadMode, worker_ids

#: JSON object of connector options (see the module doc).
CONFIG_ENV = "KVBM_TRTLLM_CONNECTOR_CONFIG"


@dataclass(frozen=True)
class TrtllmSettings:
    """One process's view of the connector: the core's settings plus where it sits."""

    core: ConnectorSettings
    block_size: int
    rank: int
    world_size: int
    #: the kvbm worker daemon of each rank (``worker_ids[rank]`` serves this process)
    worker_ids: tuple[WorkerId, ...]
    #: TensorRT-LLM's overlap scheduler (its default): the next iteration is scheduled, and a
    #: finished request's blocks may be given to another request, while the GPU still runs the
    #: iteration that may write them
    overlap_scheduler: bool = True

    @property
    def overlapping_steps(self) -> int:
        """Iterations in flight at once: two under the overlap scheduler, else one."""
        return 2 if self.overlap_scheduler else 1

    @property
    def worker_id(self) -> WorkerId:
        return self.worker_ids[self.rank]


def connector_extra(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options in :data:`CONFIG_ENV` (empty when unset).

    Raises:
        ValueError: the variable is not a JSON object.
    """
    raw = (os.environ if environ is None else environ).get(CONFIG_ENV, "").strip()
    if not raw:
        return {}
    try:
        extra = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{CONFIG_ENV} is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"{CONFIG_ENV} must be a JSON object, got {type(extra).__name__}")
    return extra


def default_namespace(llm_args: Any, block_size: int, tp_size: int) -> str:
    """What keeps models apart in kvbm's block identity: the engine (TensorRT-LLM's page layout
    differs from vLLM's), the model, its dtype and KV dtype, the block size and the KV heads'
    split over the ranks (each rank's daemon stores its own shard)."""
    kv_dtype = getattr(llm_args.kv_cache_config, "dtype", "auto")
    return f"trtllm|{getattr(llm_args, 'model', '')}|{getattr(llm_args, 'dtype', 'auto')}|kv={kv_dtype}|" \
           f"{block_size}|tp={tp_size}"


def trtllm_settings(llm_args: Any, environ: Mapping[str, str] | None = None) -> TrtllmSettings:
    """The settings of the roles built from ``llm_args`` in this process.

    Raises:
        ValueError: a malformed option, or ``worker_id`` pinned with more than one rank.
    """
    extra = connector_extra(environ)
    block_size = int(llm_args.kv_cache_config.tokens_per_block)
    mapping = llm_args.parallel_config.to_mapping()
    rank, world_size = int(mapping.rank), max(1, int(mapping.world_size))
    tp_size = max(1, int(getattr(mapping, "tp_size", world_size)))
    if "worker_id" in extra and world_size > 1:
        raise ValueError(f"{CONFIG_ENV}: worker_id pins one worker daemon; this engine has {world_size} ranks")
    core = ConnectorSettings.from_extra(extra, default_namespace(llm_args, block_size, tp_size))
    if core.load_mode is LoadMode.LAYERWISE:
        raise ValueError(f"{CONFIG_ENV}: load_mode 'layerwise' is the vLLM connector's (its per-layer waits); "
                         "use 'sync' or 'async' with TensorRT-LLM")
    return TrtllmSettings(core, block_size, rank, world_size, tuple(worker_ids(extra, world_size)),
                          overlap_scheduler=not bool(getattr(llm_args, "disable_overlap_scheduler", False)))


def config_warnings(llm_args: Any) -> list[str]:
    """What in the LLM API config makes kvbm useless or misbehave (the guide's YAML avoids all)."""
    kv = llm_args.kv_cache_config
    out = []
    if not getattr(kv, "enable_block_reuse", True):
        out.append("kv_cache_config.enable_block_reuse is false: TensorRT-LLM never asks the connector "
                   "for matches, so kvbm only stores")
    if getattr(kv, "enable_partial_reuse", False):
        out.append("kv_cache_config.enable_partial_reuse is true: a device match that ends inside a block "
                   "gets no kvbm hit (set it to false)")
    if getattr(llm_args, "cuda_graph_config", None) is not None:
        out.append("cuda_graph_config is set: the connector's per-layer hooks do not run inside CUDA graphs "
                   "(set cuda_graph_config: null)")
    return out
