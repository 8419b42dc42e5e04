"""What the scheduler role tells the worker role each step: the core's :class:`StepPlan` as
vLLM's ``KVConnectorMetadata`` (pickled by vLLM between the EngineCore and the workers)."""
from __future__ import annotations

from dataclasses import dataclass

from ..core.specs import LoadSpec, StepPlan, StoreSpec

try:  # vLLM is an optional dependency of kvbm_client
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # pragma: no cover - only without vLLM
    KVConnectorMetadata = object  # type: ignore[misc,assignment]

__all__ = ["KvbmConnectorMetadata", "LoadSpec", "StoreSpec"]


@dataclass
class KvbmConnectorMetadata(StepPlan, KVConnectorMetadata):  # type: ignore[misc,valid-type]
    """One step's loads, stores, delayed frees and fence (see :class:`StepPlan`)."""

    @classmethod
    def of(cls, plan: StepPlan) -> "KvbmConnectorMetadata":
        return cls(loads=plan.loads, stores=plan.stores, delayed_frees=plan.delayed_frees, fence=plan.fence,
                   earlier_stores=plan.earlier_stores)
