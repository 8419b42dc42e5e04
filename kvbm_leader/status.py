"""What the leader shows of itself: ``Status`` and the worker list of ``OpenSession``.

Runs in the leader; read-only, O(workers + tiers) (pinned counts are kept by the registry).
"""
from __future__ import annotations

import enum

from kvbm_client.contract import pb
from kvbm_client.ids import Tier

from .ledger import wire_tiers
from .membership import Membership
from .metrics import LeaderMetrics
from .placement import PlacementPolicy


class LeaderState(enum.Enum):
    SHUTTING_DOWN = "shutting-down"
    READY = "ready"
    WAITING_FOR_WORKERS = "waiting-for-workers"
    STARTING = "starting"


def worker_infos(membership: Membership) -> list["pb.WorkerInfo"]:
    pools = membership.pools
    epoch = pools.epoch if pools else -1
    out = []
    for rec in sorted(membership.workers.values(), key=lambda r: r.rank):
        info = pb.WorkerInfo(worker_id=rec.worker_id, rank=rec.rank, endpoint=rec.endpoint,
                             state=rec.state(epoch), alloc_progress=rec.alloc_progress, error=rec.error)
        lay = rec.layout
        if lay is not None:
            info.layout.CopyFrom(pb.KvLayout(num_layers=lay.num_layers, page_bytes=lay.page_bytes, dtype=lay.dtype,
                                             num_engine_blocks=lay.num_engine_blocks, rank=lay.rank))
            if pools is not None:
                info.host_bytes = pools.host_slots * lay.block_bytes
                info.disk_bytes = pools.disk_slots * lay.block_bytes
        out.append(info)
    return out


def leader_state(membership: Membership, closing: bool) -> LeaderState:
    if closing:
        return LeaderState.SHUTTING_DOWN
    if membership.ready:
        return LeaderState.READY
    return LeaderState.WAITING_FOR_WORKERS if not membership.all_attached else LeaderState.STARTING


def status_response(leader_id: str, state: LeaderState, placement: PlacementPolicy, membership: Membership,
                    metrics: LeaderMetrics, sessions: int, pending_jobs: int) -> "pb.StatusResponse":
    host_rate, disk_rate = metrics.hits.rates()
    tiers = [pb.TierStatus(tier=wire_tiers([tier])[0], capacity_blocks=capacity, used_blocks=used, pinned_blocks=pinned,
                           hit_rate=host_rate if tier is Tier.HOST else disk_rate)
             for tier, (capacity, used, pinned) in placement.usage().items()]
    return pb.StatusResponse(leader_id=leader_id, state=state.value, tiers=tiers, workers=worker_infos(membership),
                             sessions=sessions, pending_jobs=pending_jobs, counters=dict(metrics.values))
