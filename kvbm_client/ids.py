"""Typed identifiers shared by the leader, the workers and the connectors.

NOTE: these are ``NewType``s, so they cost nothing at run time; they exist so that a slot
number is never passed where an engine block id is expected (mypy catches it).
"""
from __future__ import annotations

import enum
from typing import NewType

#: A chained sequence hash identifying a full block (ours: 8 bytes of xxh3-64; vLLM's: 32 bytes).
BlockHash = NewType("BlockHash", bytes)
#: Index of a block in the engine's own KV cache (G1).
EngineBlockId = NewType("EngineBlockId", int)
#: Index of a block-sized slot in a worker-owned tier (G2 host pool, G3 disk file).
SlotId = NewType("SlotId", int)
#: A leader-issued transfer job (one batch of blocks).
JobId = NewType("JobId", int)
#: A worker daemon (one per GPU).
WorkerId = NewType("WorkerId", str)
#: A client session holding pins and pending jobs.
SessionId = NewType("SessionId", str)

MAX_HASH_BYTES = 64


class Tier(enum.IntEnum):
    """Storage tiers; values equal the wire enum ``kvbm.v1.Tier``."""

    DEVICE = 1  # G1, owned by the engine
    HOST = 2  # G2, pinned / shared host memory owned by the workers
    DISK = 3  # G3, local disk files owned by the workers

    @property
    def label(self) -> str:
        return {Tier.DEVICE: "G1", Tier.HOST: "G2", Tier.DISK: "G3"}[self]


class PlanKind(enum.IntEnum):
    """What a transfer plan moves; values equal the wire enum ``kvbm.v1.PlanKind``."""

    STORE = 1  # engine -> tier (offload)
    LOAD = 2  # tier -> engine (onboard)
    DEMOTE = 3  # host -> disk (leader-initiated)
    PROMOTE = 4  # disk -> host (leader-initiated, after a G3 hit)
