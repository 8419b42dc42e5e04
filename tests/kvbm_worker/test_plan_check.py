"""The worker's plan check, on CPU without daemons: every rejection and its status."""
from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from kvbm_client.contract import pb, sign_plan
from kvbm_client.ids import PlanKind, Tier
from kvbm_worker.errors import PlanRejected
from kvbm_worker.lanes import Lane
from kvbm_worker.plan_check import check_command, check_not_late, check_transfer

KEY = b"k" * 32
CODE = grpc.StatusCode


@dataclasses.dataclass
class PoolSizes:
    """The pool sizes the check reads (the real ``Pools`` holds memory besides)."""

    epoch: int = 3
    host: int = 16
    disk: int = 8

    def slots(self, tier: Tier) -> int:
        return {Tier.HOST: self.host, Tier.DISK: self.disk}.get(tier, 0)


@dataclasses.dataclass
class Shape:
    num_blocks: int = 64


def signed(kind=PlanKind.LOAD, tiers=(2,), slots=(0,), key=KEY, **fields) -> "pb.SignedPlan":
    plan = pb.TransferPlan(job_id=fields.pop("job_id", 7), kind=kind, tiers=list(tiers), slots=list(slots),
                           deadline=fields.pop("deadline", 100.0), epoch=fields.pop("epoch", 3), leader_id="L",
                           **fields)
    return sign_plan(plan, key)


def rejected(call) -> PlanRejected:
    with pytest.raises(PlanRejected) as info:
        call()
    return info.value


def transfer(plan, blocks=(5,), key=KEY, pools=PoolSizes(), region=Shape()):
    return lambda: check_transfer(plan, key, pools, region, list(blocks))


def test_a_good_load_becomes_a_batch():
    batch = check_transfer(signed(tiers=(2, 3, 2), slots=(1, 2, 3)), KEY, PoolSizes(), Shape(), [10, 11, 12])
    assert batch.kind is PlanKind.LOAD and batch.lane is Lane.LOAD and batch.job_id == 7
    assert batch.job.leader_id == "L" and batch.job.epoch == 3 and batch.deadline == 100.0
    blocks, slots = batch.entries(Tier.HOST)
    assert blocks.tolist() == [10, 12] and slots.tolist() == [1, 3]
    blocks, slots = batch.entries(Tier.DISK)
    assert blocks.tolist() == [11] and slots.tolist() == [2]
    store = check_transfer(signed(kind=PlanKind.STORE), KEY, PoolSizes(), Shape(), [5])
    assert store.lane is Lane.STORE


def test_trust_and_epoch():
    assert rejected(transfer(signed(), key=None)).code is CODE.UNAVAILABLE  # not attached
    forged = rejected(transfer(signed(key=b"x" * 32)))
    assert forged.code is CODE.PERMISSION_DENIED and forged.job_id is None  # an untrusted job id is not used
    tampered = signed()
    tampered.plan = tampered.plan[:-1] + bytes([tampered.plan[-1] ^ 1])
    assert rejected(transfer(tampered)).code is CODE.PERMISSION_DENIED
    stale = rejected(transfer(signed(epoch=2)))
    assert stale.code is CODE.FAILED_PRECONDITION and stale.job_id == 7
    assert rejected(transfer(signed(), pools=None)).code is CODE.FAILED_PRECONDITION  # no pools yet


@pytest.mark.parametrize("fields", [dict(demote_host_slots=[16], demote_disk_slots=[0]),
                                    dict(demote_host_slots=[0], demote_disk_slots=[8]),
                                    dict(promote_host_slots=[99], promote_disk_slots=[0]),
                                    dict(promote_host_slots=[0], promote_disk_slots=[2**64 - 1])])
def test_demotion_and_promotion_slots_in_range(fields):
    assert rejected(lambda: check_command(signed(kind=PlanKind.DEMOTE, tiers=(), slots=(), **fields), KEY,
                                          PoolSizes())).code is CODE.OUT_OF_RANGE


def test_entry_slots_in_their_tier():
    assert rejected(transfer(signed(slots=(16,)))).code is CODE.OUT_OF_RANGE  # G2 has 16
    assert rejected(transfer(signed(tiers=(3,), slots=(8,)))).code is CODE.OUT_OF_RANGE  # G3 has 8
    assert rejected(transfer(signed(tiers=(1,), slots=(0,)))).code is CODE.OUT_OF_RANGE  # G1 is no pool tier
    assert rejected(transfer(signed(slots=(2**64 - 1,)))).code is CODE.OUT_OF_RANGE  # no int64 wrap


def test_lengths_and_kinds():
    uneven = signed(kind=PlanKind.DEMOTE, tiers=(), slots=(), demote_host_slots=[0, 1], demote_disk_slots=[0])
    assert rejected(lambda: check_command(uneven, KEY, PoolSizes())).code is CODE.INVALID_ARGUMENT
    assert rejected(transfer(signed(tiers=(2, 2), slots=(0,)))).code is CODE.INVALID_ARGUMENT
    assert rejected(transfer(signed(kind=PlanKind.DEMOTE))).code is CODE.INVALID_ARGUMENT  # a command
    assert rejected(transfer(signed(kind=9))).code is CODE.INVALID_ARGUMENT  # unknown kind
    assert rejected(lambda: check_command(signed(kind=PlanKind.LOAD), KEY, PoolSizes())).code is CODE.INVALID_ARGUMENT
    assert rejected(transfer(signed(), blocks=(5, 6))).code is CODE.INVALID_ARGUMENT  # one block per entry
    twice = rejected(transfer(signed(tiers=(2, 2), slots=(0, 1)), blocks=(5, 5)))
    assert twice.code is CODE.INVALID_ARGUMENT and "twice" in twice.message
    check_transfer(signed(kind=PlanKind.STORE, tiers=(2, 2), slots=(0, 1)), KEY, PoolSizes(), Shape(), [5, 5])


@pytest.mark.parametrize("block", [64, 2**63, 2**64 - 1])
def test_engine_blocks_are_checked_as_unsigned(block):
    err = rejected(transfer(signed(), blocks=(block,)))
    assert err.code is CODE.OUT_OF_RANGE and str(block) in err.message and err.job_id == 7


def test_commands_and_deadlines():
    batch = check_command(signed(kind=PlanKind.PROMOTE, tiers=(), slots=(), promote_host_slots=[1, 2],
                                 promote_disk_slots=[3, 4]), KEY, PoolSizes())
    assert batch.kind is PlanKind.PROMOTE and batch.lane is Lane.STORE
    assert batch.promote_host.tolist() == [1, 2] and batch.promote_disk.tolist() == [3, 4]
    assert batch.promote_host.dtype == np.int64
    check_not_late(batch, now=99.9)
    late = rejected(lambda: check_not_late(batch, now=100.0))
    assert late.code is CODE.DEADLINE_EXCEEDED and late.job_id == 7
