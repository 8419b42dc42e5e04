"""The worker's pool state as its ``Status`` reports it: a failed allocation is "failed" with
its reason until the next try starts (a connector stops waiting on "failed", so a retry that is
still running must not look failed)."""
from __future__ import annotations

import asyncio
import threading

from kvbm_client import KvbmConfig
from kvbm_client.contract import pb
from kvbm_worker.allocation import DataPath, PoolAllocator
from kvbm_worker.lanes import Lanes

LAYOUT = pb.KvLayout(num_layers=2, page_bytes=4096, dtype="bf16", num_engine_blocks=8)


def test_a_failed_allocation_keeps_its_reason_until_the_next_try_starts(tmp_path) -> None:
    not_a_dir = tmp_path / "g3-is-a-file"
    not_a_dir.write_text("")
    allocator = PoolAllocator(KvbmConfig.from_env({"DYN_KVBM_DISK_CACHE_DIR": str(not_a_dir)}), "0", DataPath(),
                              Lanes(1))

    async def scenario() -> None:
        ok, error = await allocator.apply(pb.PoolPlan(epoch=1, host_slots=4, disk_slots=4), LAYOUT)
        assert not ok and str(not_a_dir) in error and allocator.error == error

        running, release = threading.Event(), threading.Event()
        real = allocator._allocate

        def held(*args):  # the retry, held in the executor until the test has looked
            running.set()
            release.wait(10)
            return real(*args)

        allocator._allocate = held  # type: ignore[method-assign]
        retry = asyncio.ensure_future(allocator.apply(pb.PoolPlan(epoch=2, host_slots=4, disk_slots=0), LAYOUT))
        await asyncio.get_running_loop().run_in_executor(None, running.wait, 10)
        assert allocator.error == "", "a retry in progress still reports the last failure"
        release.set()
        assert await retry == (True, "")
        assert allocator.error == "" and allocator.current is not None
        allocator.current.close()

    asyncio.run(scenario())


def test_ready_only_once_the_leader_accepted_the_plans_pools(tmp_path) -> None:
    """Allocated is not ready: the leader must have accepted this plan's PoolsReady. A new plan,
    even of the same epoch number (a new leader's epochs restart) on the same kept pools, is not
    ready until it is announced in turn."""
    allocator = PoolAllocator(KvbmConfig.from_env({}), "0", DataPath(), Lanes(1))

    async def scenario() -> None:
        assert await allocator.apply(pb.PoolPlan(epoch=1, host_slots=4, disk_slots=0), LAYOUT) == (True, "")
        assert allocator.current is not None and not allocator.ready
        allocator.announce(1)
        assert allocator.ready
        assert await allocator.apply(pb.PoolPlan(epoch=1, host_slots=4, disk_slots=0), LAYOUT) == (True, "")
        assert not allocator.ready, "a new leader's epoch 1 on the kept pools counted as announced"
        allocator.announce(1)
        assert allocator.ready
        allocator.current.close()

    asyncio.run(scenario())
