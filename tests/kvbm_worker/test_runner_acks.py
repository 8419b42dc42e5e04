"""Command acknowledgements for transports without statuses (NATS): a rejection is an answer,
signed by the worker when the plan's signature verified (so its job id is the leader's)."""
from __future__ import annotations

import asyncio

from kvbm_client import KvbmConfig
from kvbm_client.contract import pb, sign_plan
from kvbm_client.ids import PlanKind, WorkerId
from kvbm_client.security import NodeKey, ack_is_authentic
from kvbm_worker.allocation import DataPath, PoolAllocator
from kvbm_worker.lanes import Lanes
from kvbm_worker.region_registry import RegionRegistry
from kvbm_worker.regions import EngineRegion, RegionLimits
from kvbm_worker.runner import JobRunner

NODE_KEY = NodeKey(b"n" * 32)


class Attached:
    """The runner's view of a leader link attached to leader "L" (no leader is called here)."""

    leader_id = "L"
    plan_key = NODE_KEY.plan_key("L")
    grace = 5.0

    async def start_job(self, job):
        raise AssertionError("a rejected command must not ask the leader to start")

    async def report(self, report):
        raise AssertionError("a rejected command is not reported")


async def _nothing() -> None:
    pass


def runner() -> JobRunner:
    config = KvbmConfig.from_env({})
    lanes = Lanes(4)
    regions = RegionRegistry("0", RegionLimits(), EngineRegion, _nothing)
    return JobRunner(WorkerId("0"), lanes, regions, PoolAllocator(config, "0", DataPath(), lanes), Attached(),
                     NODE_KEY)


def command(key: bytes, job_id: int = 41) -> "pb.CommandRequest":
    plan = pb.TransferPlan(job_id=job_id, kind=PlanKind.DEMOTE, demote_host_slots=[0], demote_disk_slots=[0],
                           deadline=1e18, epoch=1, leader_id="L")
    return pb.CommandRequest(plan=sign_plan(plan, key))


def test_a_rejected_command_is_acknowledged_and_signed():
    resp = asyncio.run(runner().acknowledge(command(Attached.plan_key)))  # no pools yet: refused
    assert not resp.ok and resp.error.startswith("FAILED_PRECONDITION")
    assert resp.job_id == 41 and ack_is_authentic(NODE_KEY, resp, "0", 41)
    assert not ack_is_authentic(NODE_KEY, resp, "0", 42), "a signed refusal of one job must not do for another"


def test_a_forged_plan_gets_no_signature():
    resp = asyncio.run(runner().acknowledge(command(b"x" * 32)))
    assert not resp.ok and resp.error.startswith("PERMISSION_DENIED")
    assert not resp.signature and not ack_is_authentic(NODE_KEY, resp, "0", 41)
