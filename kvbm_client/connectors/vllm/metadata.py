"""What the scheduler role tells the worker role each step (pickled by vLLM between the
EngineCore and the worker processes): plain dataclasses of bytes and ints."""
from __future__ import annotations

from dataclasses import dataclass, field

try:  # vLLM is an optional dependency of kvbm_client
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # pragma: no cover - only without vLLM
    KVConnectorMetadata = object  # type: ignore[misc,assignment]


@dataclass
class LoadSpec:
    """Onboard a request's external prefix: the leader's signed plan and the engine blocks."""

    req_id: str
    plan: bytes
    signature: bytes
    engine_blocks: list[int]
    #: loaded before this step's forward (vLLM counted the tokens as computed); else the
    #: request waits for ``finished_recving``.
    sync: bool = False


@dataclass
class StoreSpec:
    """Offload newly computed blocks of one step (several requests in one plan)."""

    plan: bytes
    signature: bytes
    engine_blocks: list[int]
    req_ids: list[str]


@dataclass
class KvbmConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc,valid-type]
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    #: finished requests whose blocks stay allocated until their stores are done
    #: (the worker role reports them in ``finished_sending``).
    delayed_frees: list[str] = field(default_factory=list)
    #: a request with stores in flight was preempted (its blocks are free again): the worker
    #: waits for every store in flight before this step's forward can rewrite them.
    fence: bool = False
