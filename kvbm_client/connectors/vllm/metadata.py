"""What the scheduler role tells the worker role each step: the core's :class:`StepPlan` as
vLLM's ``KVConnectorMetadata`` (pickled by vLLM between the EngineCore and the workers); and
what the worker roles tell it back (vLLM >= 0.26's ``KVConnectorWorkerMetadata``): the held
stores they settled (:mod:`kvbm_client.connectors.core.block_holds`)."""
from __future__ import annotations

from dataclasses import dataclass

from ..core.specs import LoadSpec, StepPlan, StoreSpec

try:  # vLLM is an optional dependency of kvbm_client
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # pragma: no cover - only without vLLM
    KVConnectorMetadata = object  # type: ignore[misc,assignment]
try:  # vLLM >= 0.26
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - an older vLLM: no worker metadata, so no block holds
    KVConnectorWorkerMetadata = object  # type: ignore[misc,assignment]

__all__ = ["KvbmConnectorMetadata", "KvbmWorkerMetadata", "LoadSpec", "StoreSpec"]


@dataclass
class KvbmConnectorMetadata(StepPlan, KVConnectorMetadata):  # type: ignore[misc,valid-type]
    """One step's loads, stores, delayed frees and fence (see :class:`StepPlan`)."""

    @classmethod
    def of(cls, plan: StepPlan) -> "KvbmConnectorMetadata":
        return cls(loads=plan.loads, stores=plan.stores, delayed_frees=plan.delayed_frees, fence=plan.fence,
                   earlier_stores=plan.earlier_stores)


@dataclass
class KvbmWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc,valid-type]
    """One step's worker-side reports: the ids of the held stores each worker role settled
    (one entry per worker role and store; vLLM aggregates the workers' objects)."""

    settled_stores: tuple[int, ...] = ()

    def aggregate(self, other: "KvbmWorkerMetadata") -> "KvbmWorkerMetadata":
        return KvbmWorkerMetadata(self.settled_stores + tuple(getattr(other, "settled_stores", ())))
