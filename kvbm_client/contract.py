"""The gRPC contract's Python side: generated messages and stubs, plus plan signing.

Generated code lives in ``kvbm_client/_gen`` (committed; ``python proto/generate.py --check``
verifies it is current). Everything else imports the contract from here.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from ._gen.kvbm.v1 import kvbm_pb2 as pb
from ._gen.kvbm.v1 import kvbm_pb2_grpc as rpc
from .ids import PlanKind, Tier

#: ``TransferRequest.layer_groups`` accepted at most (the worker answers INVALID_ARGUMENT above)
MAX_LAYER_GROUPS = 64
#: The engine's signal page (``RegisterRegionRequest.signals``): exactly this many bytes, one
#: little-endian uint32 word per slot (``TransferRequest.signal_slot`` is 1 + a word's index)
SIGNAL_PAGE_BYTES = 4096
SIGNAL_SLOTS = SIGNAL_PAGE_BYTES // 4

__all__ = ["pb", "rpc", "sign_plan", "verify_plan", "GRPC_OPTIONS", "MatchResult"]

#: Channel/server options shared by every side: large batches fit, dead peers are noticed.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Servers must accept the clients' keepalive pings, else they answer GOAWAY
    # "too_many_pings" and the worker's attach stream (and its blocks) would drop.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    # Peers are local daemons that restart in about a second: redial quickly instead of
    # gRPC's default reconnect backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The answer of a lookup: the longest present prefix and the tier of each of its blocks
    (G2 preferred over G3). The leader's placement computes it; ``Match`` carries it."""

    num_matched: int
    tiers: tuple[Tier, ...]

    @classmethod
    def from_response(cls, resp: "pb.MatchResponse") -> "MatchResult":
        return cls(resp.num_matched, tuple(Tier(t) for t in resp.tiers))


def sign_plan(plan: "pb.TransferPlan", secret: bytes) -> "pb.SignedPlan":
    """Serialize ``plan`` and sign it with the leader's secret."""
    data = plan.SerializeToString(deterministic=True)
    return pb.SignedPlan(plan=data, signature=hmac.new(secret, data, hashlib.sha256).digest())


def verify_plan(signed: "pb.SignedPlan", secret: bytes) -> "pb.TransferPlan | None":
    """Return the plan when its signature is the leader's, else ``None``."""
    expected = hmac.new(secret, signed.plan, hashlib.sha256).digest()
    if not hmac.compare_digest(expected, signed.signature):
        return None
    plan = pb.TransferPlan()
    plan.ParseFromString(signed.plan)
    return plan


def plan_tiers(plan: "pb.TransferPlan") -> list[Tier]:
    return [Tier(t) for t in plan.tiers]


def plan_kind(plan: "pb.TransferPlan") -> PlanKind:
    return PlanKind(plan.kind)
