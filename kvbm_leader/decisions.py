"""What a placement decision is: the job's reads and writes, and what its completion did.

Runs in the leader; plain data, no behaviour beyond derived views.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from kvbm_client.ids import BlockHash, JobId, PlanKind, SlotId, Tier


@dataclass(frozen=True, slots=True)
class HostDiskMove:
    """One block copied between a G2 slot and a G3 slot; which way is said by the list it is
    in (``JobPlacement.demotions``: G2 -> G3, ``.promotions``: G3 -> G2)."""

    key: BlockHash
    host_slot: SlotId
    disk_slot: SlotId


@dataclass(slots=True)
class JobPlacement:
    """The placement part of a job: what each entry reads or writes (the wire form is
    ``pb.TransferPlan``, built by :mod:`.ledger`)."""

    job_id: JobId
    kind: PlanKind
    keys: list[BlockHash] = field(default_factory=list)
    tiers: list[Tier] = field(default_factory=list)
    slots: list[SlotId] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)  # STORE: index into the request
    demotions: list[HostDiskMove] = field(default_factory=list)
    promotions: list[HostDiskMove] = field(default_factory=list)
    skipped_present: int = 0
    skipped_full: int = 0
    skipped_cost: int = 0  # LOAD: matched blocks after ``keys`` left to recompute (cheaper than loading)
    dropped: int = 0  # evicted without a copy elsewhere
    skipped_demotions: int = 0  # STORE: of ``dropped``, blocks worth G3 left out (demotion limit spent)

    @property
    def is_empty(self) -> bool:
        return not self.keys and not self.demotions and not self.promotions

    def references(self) -> Iterable[tuple[BlockHash, Tier, SlotId]]:
        """Every (block, tier, slot) this job reads or writes."""
        yield from zip(self.keys, self.tiers, self.slots)
        for move in (*self.demotions, *self.promotions):
            yield move.key, Tier.HOST, move.host_slot
            yield move.key, Tier.DISK, move.disk_slot


@dataclass(slots=True)
class Outcome:
    """What a completed job did, for metrics (Dynamo's names in comments)."""

    stored: dict[Tier, int] = field(default_factory=lambda: {Tier.HOST: 0, Tier.DISK: 0})  # d2h, d2d
    demoted: int = 0  # offload_blocks_h2d (host -> disk)
    loaded: dict[Tier, int] = field(default_factory=lambda: {Tier.HOST: 0, Tier.DISK: 0})  # h2d, d2d
    promoted: int = 0  # disk -> host
    #: STORE: blocks made matchable, with their tier (for the KV events)
    ready: list[tuple[BlockHash, Tier]] = field(default_factory=list)
