"""Connector settings: the engine's connector config first (vLLM's ``kv_connector_extra_config``),
then the ``DYN_KVBM_*`` environment (the same defaults as ``kvbm serve``)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...config import KvbmConfig, parse_bool
from ...contract import MAX_LAYER_GROUPS
from ...ids import WorkerId
from ...layer_groups import group_bounds


class LoadMode(str, enum.Enum):
    """When a hit is loaded (compares equal to its string value)."""

    #: in the step that computes the rest of the prompt (the engine waits for the copy; one
    #: step less, the lowest TTFT)
    SYNC = "sync"
    #: while the request waits (vLLM's WAITING_FOR_REMOTE_KVS) and other requests keep
    #: running (no stall of their decodes)
    ASYNC = "async"
    #: a synchronous load whose forward waits per layer: the daemon copies it in
    #: ``layer_groups`` groups in layer order and the forward of layer L waits only for L's
    #: pages (the engine's layer hooks, which FULL CUDA graphs skip: ``min_computed_tokens``). Never chosen
    #: by ``auto``: a failed load is recomputed like a failed synchronous one.
    LAYERWISE = "layerwise"
    #: the engine's connector picks one of the two (the configured default): synchronous
    #: unless the engine recomputes a failed synchronous load wrongly (see the vLLM connector's
    #: ``compat.auto_load_mode``). A resolved :class:`ConnectorSettings` never holds it.
    AUTO = "auto"


LOAD_MODES = tuple(m.value for m in LoadMode)


class GpuWaits(str, enum.Enum):
    """Where a layer-pipelined load's forward waits for its layers (``gpu_layer_waits``)."""

    #: on the CPU, per layer (the engine's thread waits before it enqueues the layer)
    OFF = "false"
    #: on the GPU (a wait kernel on the signal page) only where CUDA loads kernels eagerly
    #: (``CUDA_MODULE_LOADING=EAGER``); the CPU otherwise
    EAGER = "eager"
    #: on the GPU under either module loading mode (under lazy loading, a launch that loads a
    #: module while a wait spins holds the engine's thread until the wait ends)
    ON = "true"
    #: the last layers' waits (:func:`tail_layers`) on the GPU under either module loading mode,
    #: the others on the CPU: the engine's thread waits until the load is nearly done, then
    #: enqueues the rest of the forward (and its sampling) while the last groups are copied
    TAIL = "tail"
    #: the waits after the daemon's first layer group (:func:`first_group_end`) on the GPU under
    #: either module loading mode: the engine's thread waits on the CPU for the first group
    #: (the daemon issues its first pieces without the engine enqueueing beside it), then
    #: enqueues the whole rest of the forward at once, so an engine whose thread is slower per
    #: layer than the copy (eager mode) never trails the copy's end
    AFTER_FIRST = "after_first"


def first_group_end(pages_per_block: int, layer_groups: int) -> int:
    """The end page of the worker daemon's first front-loaded layer group
    (:func:`~kvbm_client.layer_groups.group_bounds`: 36 pages in 6 groups end at 11): the layers
    ``gpu_layer_waits`` after_first waits for on the CPU."""
    return group_bounds(pages_per_block, layer_groups)[0]


def tail_layers(pages_per_block: int, layer_groups: int) -> int:
    """How many of a block's last pages (layers) wait on the GPU under ``gpu_layer_waits`` tail:
    the daemon's last two layer groups of its default (front-loaded) shape, ~4/groups**2 of the
    layers (36 layers in 6 groups: the last 4), at least 1."""
    return max(1, min(pages_per_block, round(pages_per_block * 4 / (layer_groups * layer_groups))))


def gpu_waits_from(waits: GpuWaits, pages_per_block: int, layer_groups: int) -> int:
    """Under ``waits``, a layer-pipelined load's waits for pages ending at or before the
    returned page stay on the CPU (``GpuWait.gpu_from``; 0: every wait on the GPU)."""
    if waits is GpuWaits.TAIL:
        return pages_per_block - tail_layers(pages_per_block, layer_groups)
    if waits is GpuWaits.AFTER_FIRST:
        return first_group_end(pages_per_block, layer_groups)
    return 0


def parse_gpu_waits(value: Any) -> GpuWaits:
    """``gpu_layer_waits`` from an engine's config: a boolean, "eager", "tail" or "after_first"."""
    if isinstance(value, GpuWaits):
        return value
    word = str(value).strip().lower()
    if word in (GpuWaits.EAGER.value, GpuWaits.TAIL.value, GpuWaits.AFTER_FIRST.value):
        return GpuWaits(word)
    try:
        return GpuWaits.ON if parse_bool(value) else GpuWaits.OFF
    except ValueError:
        raise ValueError(f"kv_connector_extra_config.gpu_layer_waits={value!r}: true, false, eager, tail or after_first") from None
#: ``async_store_min_blocks`` default. A ``PrepareStore`` of a few blocks is short (1.2-1.4 ms for
#: 10 on an H100 host), and in a warm request's step it is hidden behind the load's copy; asked
#: for off the scheduler's thread it overlapped the forward's enqueueing instead, and the 20K warm
#: TTFT was 92.2 against 86.8 ms (machine r, 2026-11-26, 2 passes each, one run). A cold 20K
#: prefill's steps store 1024 and 234 blocks (3-7 ms each on the scheduler's thread).
DEFAULT_ASYNC_STORE_MIN_BLOCKS = 64
#: ``layer_groups`` default: 6 groups of a 36-layer model move 384 KiB per block and group
#: (direct DMA stays near full speed), and the forward after the last group is a sixth of it.
DEFAULT_LAYER_GROUPS = 6


@dataclass(frozen=True)
class ConnectorSettings:
    leader_address: str
    worker_address_template: str  # "{id}" is replaced by the worker id
    #: what keeps models apart in kvbm's block identity (default: model, dtype, block size)
    namespace: str
    timeout_s: float
    retry_s: float
    ready_timeout_s: float = 120.0
    load_mode: LoadMode = LoadMode.SYNC
    #: the scheduler side starts a hit's copy on the worker daemons as soon as the engine
    #: allocated its blocks (see :mod:`.early_loads`); false: the worker side starts it.
    early_loads: bool = True
    #: with early loads and layer groups: the lookup asks the leader to stage a new hit on the
    #: worker daemons that have a staging area (``kvbm-worker --stage-mib``, 0 by default: the
    #: area is the opt-in) before it answers, so its copy starts before the engine allocated its
    #: blocks (see kvbm_worker/stages.py); false: nothing moves before the blocks exist
    staged_loads: bool = True
    #: the node's settings as this engine sees them (channels: TLS, tokens, message sizes)
    config: KvbmConfig = field(default_factory=KvbmConfig)
    #: where worker "{id}" takes engine regions (a unix socket path; default: in the socket dir)
    region_socket_template: str = ""
    #: what both sides of one engine share (vLLM: ``kv_transfer_config.engine_id``): the
    #: scheduler side finds the region ids of its worker side under it (:mod:`.region_ids`)
    engine_id: str = ""
    #: send the engine's prefill speed with each lookup, so the leader loads a hit only as far
    #: as loading beats recomputing it (kvbm_leader/onboard_cost.py); false: load every hit
    cost_aware_loads: bool = True
    #: the prefill speed assumed until a step was measured (tokens/s; 0: unknown, load every hit)
    prefill_tokens_per_s: float = 0.0
    #: ``load_mode`` layerwise: the groups of layers a load is copied in (2..64)
    layer_groups: int = DEFAULT_LAYER_GROUPS
    #: ``load_mode`` layerwise on a GPU: where the forward's layer waits go (:class:`GpuWaits`).
    #: On the GPU (a wait kernel on the engine's signal page, :mod:`kvbm_client.signal_page`) the
    #: engine's CPU enqueues the whole forward while the copy runs; on the CPU it waits per layer.
    #: Default ``tail`` since 2026-11-26 (tenth session): 20K eager 6.4-6.6 % faster than ``eager``
    #: on two H100s (both reproduced), greedy with graphs and the stress run identical
    gpu_layer_waits: GpuWaits = GpuWaits.TAIL
    #: the fewest tokens of a prompt the engine computes itself when kvbm loads the rest: the
    #: last one (its logits); more where a step with few new tokens would run as a FULL CUDA
    #: graph that skips the layer hooks (the vLLM connector's ``compat.layerwise_graph_fit``)
    min_computed_tokens: int = 1
    #: plan each step's stores off the scheduler's thread (the leader's ``PrepareStore`` runs
    #: while the step does; the stores ship with the next step, :mod:`.store_planner`); false:
    #: on the scheduler's thread, before the step runs (the behaviour before 2026-11-26).
    #: Used by the vLLM connector (its worker role sends such stores before the next forward);
    #: the TensorRT-LLM connector plans on the scheduler's thread whatever this says
    async_store_plans: bool = True
    #: with ``async_store_plans``: the fewest new blocks a step must complete for its stores to be
    #: planned off the scheduler's thread (:data:`DEFAULT_ASYNC_STORE_MIN_BLOCKS`)
    async_store_min_blocks: int = DEFAULT_ASYNC_STORE_MIN_BLOCKS
    #: with ``async_store_plans``: a step that loads nothing (decode steps, a cold prompt's last
    #: chunk) plans its stores off the scheduler's thread whatever their number; false: only
    #: ``async_store_min_blocks`` decides, as before 2026-11-27's twenty-third session (a small
    #: ``PrepareStore`` holds vLLM's scheduler thread for its round trip, 1.8 ms on an H100 host;
    #: off it, the scheduler hooks took 0.29-0.42 instead of 0.59-0.65 ms per decode step)
    async_decode_store_plans: bool = True
    #: vLLM on a GPU: ask for one cross-layer KV buffer (a block is one contiguous run, the
    #: fastest copies); false: vLLM's per-layer tensors (each block's slice per layer one page)
    cross_layer_blocks: bool = True
    #: answer a lookup whose first block the leader's presence filter rules out as a miss,
    #: without a round trip (:mod:`kvbm_client.presence`); false: every lookup asks the leader
    presence_filter: bool = True
    #: offload the engine's computed blocks (write-through to G2); false: this engine only loads
    #: hits and never writes to the node's cache (a read-only consumer)
    store_blocks: bool = True
    #: vLLM >= 0.26: pin the blocks a store still reads in vLLM's block pool and free a finished
    #: request's other blocks at once (:mod:`.block_holds`); false: a finished request keeps all
    #: its blocks until its stores are done (a delayed free, the behaviour before 2026-11-27).
    #: Engines without a pool to pin in (TensorRT-LLM, older vLLM) always delay
    hold_stored_blocks: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "load_mode", _load_mode(self.load_mode))
        object.__setattr__(self, "gpu_layer_waits", parse_gpu_waits(self.gpu_layer_waits))
        if self.load_mode is LoadMode.AUTO:
            raise ValueError("ConnectorSettings.load_mode: resolve 'auto' first (from_extra's auto_load_mode)")
        if not 2 <= self.layer_groups <= MAX_LAYER_GROUPS:
            raise ValueError(f"kv_connector_extra_config.layer_groups={self.layer_groups}: 2 to {MAX_LAYER_GROUPS}")
        if self.async_store_min_blocks < 1:
            raise ValueError(f"kv_connector_extra_config.async_store_min_blocks={self.async_store_min_blocks}: "
                             "at least 1")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], default_namespace: str, engine_id: str = "",
                   auto_load_mode: LoadMode = LoadMode.SYNC) -> "ConnectorSettings":
        """Settings from an engine's connector config dict (``extra``); ``load_mode`` "auto" (the
        default) becomes ``auto_load_mode``, the mode the engine's connector chose for it."""
        overrides = {k: extra[k] for k in ("socket_dir", "leader_address") if extra.get(k)}
        cfg = KvbmConfig.from_env(**overrides)
        template = extra.get("worker_address") or cfg.worker_address("{id}")
        mode = configured_load_mode(extra)
        return cls(config=cfg, leader_address=cfg.resolved_leader_address, worker_address_template=template,
                   region_socket_template=str(extra.get("region_socket") or cfg.region_socket("{id}")),
                   engine_id=engine_id,
                   namespace=str(extra.get("namespace") or default_namespace),
                   timeout_s=float(extra.get("timeout_s", 2.0)), retry_s=float(extra.get("retry_s", 2.0)),
                   ready_timeout_s=float(extra.get("ready_timeout_s", 120.0)),
                   load_mode=auto_load_mode if mode is LoadMode.AUTO else mode,
                   early_loads=_flag("early_loads", extra.get("early_loads", True)),
                   staged_loads=_flag("staged_loads", extra.get("staged_loads", True)),
                   cost_aware_loads=_flag("cost_aware_loads", extra.get("cost_aware_loads", cfg.cost_aware_loads)),
                   prefill_tokens_per_s=float(extra.get("prefill_tokens_per_s", cfg.prefill_tokens_per_s)),
                   layer_groups=_int("layer_groups", extra.get("layer_groups", DEFAULT_LAYER_GROUPS)),
                   gpu_layer_waits=parse_gpu_waits(extra.get("gpu_layer_waits", GpuWaits.TAIL)),
                   async_store_plans=_flag("async_store_plans", extra.get("async_store_plans", True)),
                   async_store_min_blocks=_int("async_store_min_blocks", extra.get("async_store_min_blocks",
                                                                       DEFAULT_ASYNC_STORE_MIN_BLOCKS)),
                   async_decode_store_plans=_flag("async_decode_store_plans",
                                                  extra.get("async_decode_store_plans", True)),
                   cross_layer_blocks=_flag("cross_layer_blocks", extra.get("cross_layer_blocks", True)),
                   presence_filter=_flag("presence_filter", extra.get("presence_filter", True)),
                   store_blocks=_flag("store_blocks", extra.get("store_blocks", True)),
                   hold_stored_blocks=_flag("hold_stored_blocks", extra.get("hold_stored_blocks", True)))

    @property
    def sync_loads(self) -> bool:
        """Loads counted as computed in the step that prefills the rest (sync and layerwise)."""
        return self.load_mode in (LoadMode.SYNC, LoadMode.LAYERWISE)

    @property
    def load_layer_groups(self) -> int:
        """``TransferRequest.layer_groups`` of this engine's loads (0: whole blocks)."""
        return self.layer_groups if self.load_mode is LoadMode.LAYERWISE else 0

    def worker_address(self, worker_id: str) -> str:
        return self.worker_address_template.replace("{id}", worker_id)

    def region_socket(self, worker_id: str) -> str:
        return (self.region_socket_template or self.config.region_socket("{id}")).replace("{id}", worker_id)


def configured_load_mode(extra: Mapping[str, Any]) -> LoadMode:
    """The ``load_mode`` an engine's connector config asks for (checked; default "auto")."""
    return _load_mode(extra.get("load_mode", LoadMode.AUTO))


def _load_mode(value: Any) -> LoadMode:
    try:
        return LoadMode(str(value.value if isinstance(value, LoadMode) else value).lower())
    except ValueError:
        raise ValueError(f"kv_connector_extra_config.load_mode={value!r}: one of {', '.join(LOAD_MODES)}") from None


def _int(name: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config.{name}={value!r}: an integer") from None


def _flag(name: str, value: Any) -> bool:
    try:
        return parse_bool(value)
    except ValueError:
        raise ValueError(f"kv_connector_extra_config.{name}={value!r}: true or false") from None


class Backoff:
    """Circuit breaker for an unreachable service: try at most once per ``period``."""

    def __init__(self, period: float) -> None:
        self.period = period
        self._next = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self._next

    def failed(self) -> None:
        self._next = time.monotonic() + self.period

    def reset(self) -> None:
        self._next = 0.0


def worker_ids(ids: Mapping[str, Any] | None, default_count: int) -> list[WorkerId]:
    """The worker daemons of an engine: ``ids["worker_id"]`` (one, pinned in the config) or
    one per tensor-parallel rank ``0 .. default_count-1``."""
    if ids and "worker_id" in ids:
        return [WorkerId(str(ids["worker_id"]))]
    return [WorkerId(str(r)) for r in range(default_count)]
