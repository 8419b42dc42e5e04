"""The worker's region registry: several regions of one shape, the limit, the layout the
leader sees, and regions never closed under a copy. Real memfds, no daemon."""
from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from kvbm_client import ShmKvBuffer
from kvbm_worker.errors import JobFailed, RegionRejected
from kvbm_worker.region_registry import RegionRegistry
from kvbm_worker.regions import EngineRegion, Peer, RegionLimits

ME = Peer(os.getpid(), os.getuid(), os.getgid())


class Rig:
    def __init__(self, max_regions: int = 3) -> None:
        self.changes = 0
        self.buffers: list[ShmKvBuffer] = []
        self.registry = RegionRegistry("0", RegionLimits(max_regions=max_regions), EngineRegion, self._changed)

    async def _changed(self) -> None:
        self.changes += 1

    async def add(self, num_blocks: int = 8, num_layers: int = 2, page_bytes: int = 4096) -> EngineRegion:
        buf = ShmKvBuffer(num_blocks, num_layers, page_bytes)
        self.buffers.append(buf)
        spec = buf.spec()
        return await self.registry.register(spec.to_request(), spec.fds, ME)

    def close(self) -> None:
        self.registry.close()
        for b in self.buffers:
            b.close()


def run(coro_fn):
    rig = Rig()
    try:
        asyncio.run(coro_fn(rig))
    finally:
        rig.close()


def test_regions_of_one_shape_are_held_together_and_named_by_their_ids():
    async def body(rig: Rig) -> None:
        a, b = await rig.add(num_blocks=8), await rig.add(num_blocks=5)
        assert a.region_id != b.region_id and rig.registry.get(b.region_id) is b
        assert [s.num_blocks for s in rig.registry.summaries()] == [8, 5]
        assert all(s.pid == os.getpid() for s in rig.registry.summaries())
        assert rig.changes == 1, "the layout is announced once, by the first region"
        assert rig.registry.layout(3).num_engine_blocks == 8 and rig.registry.layout(3).rank == 3
    run(body)


def test_another_shape_and_one_region_too_many_are_refused():
    async def body(rig: Rig) -> None:
        await rig.add()
        with pytest.raises(RegionRejected) as info:
            await rig.add(num_layers=3)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "3 layers x 4096" in info.value.message and "2 layers x 4096" in info.value.message
        await rig.add()
        await rig.add()
        with pytest.raises(RegionRejected) as info:
            await rig.add()
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "DYN_KVBM_MAX_REGIONS" in info.value.message
    run(body)


def test_the_announced_layout_survives_an_engine_coming_back_with_other_num_blocks():
    async def body(rig: Rig) -> None:
        a = await rig.add(num_blocks=8)
        await rig.registry.unregister(a.region_id)
        assert rig.registry.layout(0) is None, "no region held: no layout to plan pools for"
        await rig.add(num_blocks=6)
        assert rig.registry.layout(0).num_engine_blocks == 8, "the leader would replan (and drop every block)"
        only = rig.registry.regions[0]
        await rig.registry.unregister(only.region_id)
        await rig.add(num_blocks=6, page_bytes=2048)  # a new shape with no region held: announced
        assert rig.registry.layout(0).page_bytes == 2048 and rig.changes == 3
    run(body)


def test_a_region_is_closed_only_after_the_copy_holding_it():
    async def body(rig: Rig) -> None:
        region = await rig.add()
        copying = asyncio.Event()
        finish = asyncio.Event()

        async def copy() -> None:
            with region.use():
                copying.set()
                await finish.wait()
                assert region.layer_views, "the region was unmapped under a copy"

        job = asyncio.ensure_future(copy())
        await copying.wait()
        gone = asyncio.ensure_future(rig.registry.unregister(region.region_id))
        await asyncio.sleep(0.05)
        assert not gone.done() and rig.registry.get(region.region_id) is None
        with pytest.raises(JobFailed) as info:  # no new copy once it is going
            with region.use():
                pass
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        finish.set()
        await job
        await gone
        assert region.layer_views == []
        with pytest.raises(RegionRejected) as refused:
            await rig.registry.unregister(region.region_id)
        assert refused.value.code == grpc.StatusCode.NOT_FOUND
    run(body)
