"""The leader's persistent G3 index and its restore (DYN_KVBM_DISK_PERSIST), on real SQLite files
without daemons: the journal the registry writes, the join with every rank's shard index (the
workers' own ShardIndex writes them here), the layout fingerprint, a reset during a restore,
write errors, the lock."""
from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any, Coroutine

import numpy as np
import pytest

from kvbm_client.config import KvbmConfig
from kvbm_client.errors import KvbmConfigError
from kvbm_client.g3_files import leader_index_path, shard_fingerprint, worker_files, write_tag
from kvbm_client.ids import BlockHash, JobId, SlotId, Tier, WorkerId
from kvbm_leader.events import KvEventFeed, NullEvents
from kvbm_leader.g3_index import G3Index
from kvbm_leader.membership import Layout, Membership, WorkerRecord
from kvbm_leader.metrics import LeaderMetrics
from kvbm_leader.placement import PlacementPolicy
from kvbm_leader.policies.frequency import FrequencyFilter
from kvbm_client.g3_files import ShardTags, join
from kvbm_leader.restore import G3Restorer
from kvbm_worker.disk_index import ShardIndex
from kvbm_worker.id_arrays import Slots

from support.mounts import mounted

W0, W1 = WorkerId("0"), WorkerId("1")
LEADER = "leader-old"
DISK = Tier.DISK


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


# ---------------------------------------------------------------------------- join (pure)
def shard(num_slots: int, rows: dict[int, int]) -> ShardTags:
    has, tags = np.zeros(num_slots, bool), np.zeros(num_slots, np.int64)
    for s, t in rows.items():
        has[s], tags[s] = True, t
    return ShardTags(has, tags)


def test_join_keeps_a_row_only_when_every_rank_has_its_tag() -> None:
    slots, tags = np.array([0, 1, 2, 3, 9]), np.array([10, 11, 12, 13, 19])
    shards = {W0: shard(8, {0: 10, 1: 11, 2: 12, 3: 13}), W1: shard(8, {0: 10, 1: 99, 3: 13})}
    keep, why = join(slots, tags, 8, shards)
    assert keep.tolist() == [True, False, False, True, False]
    assert why == {"outside the G3 size": 1, "worker 1: slot rewritten since": 1,
                   "worker 1: no record of the slot (write unfinished, or its G3 file or index lost)": 1}


def test_join_a_missing_rank_restores_nothing() -> None:
    shards = {W0: shard(4, {0: 5, 1: 6}), W1: "its shard index is missing"}
    keep, why = join(np.array([0, 1]), np.array([5, 6]), 4, shards)
    assert not keep.any() and why == {"worker 1: its shard index is missing": 2}


def test_join_a_slot_named_twice_keeps_the_latest_row() -> None:
    keep, why = join(np.array([3, 3]), np.array([7, 7]), 4, {W0: shard(4, {3: 7})})
    assert keep.tolist() == [False, True] and why == {"slot named twice": 1}


# ---------------------------------------------------------------------------- a node, in objects
class Node:
    """A leader's membership, placement and G3 index over two workers' shard indexes in ``root``."""

    def __init__(self, root: Path, layers: int = 2, leader_id: str = LEADER, slots: int = 16) -> None:
        self.root, self.layers = root, layers
        self.config = KvbmConfig(disk_cache_override_num_blocks=slots, disk_cache_dir=str(root), disk_persist=True)
        self.metrics = LeaderMetrics()
        self.index = G3Index(leader_index_path(str(root)), leader_id, self.metrics)
        self.placement = PlacementPolicy({DISK: slots}, FrequencyFilter(100, enabled=False), self.index)
        self.membership = Membership(self.config, [W0, W1])
        for rank, w in enumerate((W0, W1)):
            self.membership.attach(WorkerRecord(w, rank, f"unix:/w{w}", 1, False))
            self.membership.set_layout(w, Layout(layers, 4096, "bf16", 8, rank))
        self.restorer = G3Restorer(self.index, self.placement, self.membership, KvEventFeed(NullEvents()),
                                   self.metrics)

    def shard_index(self, worker: WorkerId) -> str:
        return worker_files(str(self.root), worker, shard_fingerprint(self.layers, 4096, "bf16"))[1]

    def commit(self, i: int, slot: int, job: int) -> None:
        """Block ``i`` stored in G3 ``slot`` by ``job`` and committed (the registry journals it)."""
        reg = self.placement.registry
        reg.add_copy(reg.entry(key(i), key(i - 1)), DISK, SlotId(slot), JobId(job))
        reg.mark_ready(reg.entry(key(i)), DISK)

    def pools_ready(self) -> "asyncio.Task[None]":
        """A new pool epoch, every worker reporting it ready (with its shard index path), as the
        fleet does: the last report starts the restore, which is returned (not awaited)."""
        sizes = self.membership.replan()
        assert sizes is not None
        self.placement.resize({DISK: sizes.disk_slots})
        for w in (W0, W1):
            self.membership.workers[w].ready_epoch = sizes.epoch
            self.restorer.pools_ready(w, self.shard_index(w))
        assert self.membership.restoring == sizes.epoch and not self.membership.ready
        task = self.restorer._task
        assert task is not None
        return task

    async def restore(self) -> None:
        """:meth:`pools_ready`, and the restore runs to its end."""
        await self.pools_ready()

    def rows(self) -> list[tuple[bytes, int]]:
        conn = sqlite3.connect(leader_index_path(str(self.root)))
        try:
            return conn.execute("SELECT key, slot FROM blocks ORDER BY rowid").fetchall()
        finally:
            conn.close()


def worker_rows(root: Path, worker: WorkerId, layers: int, rows: dict[int, int]) -> None:
    """Worker ``worker``'s shard index with ``slot -> job`` rows of ``LEADER``'s jobs."""
    index = ShardIndex(worker_files(str(root), worker, shard_fingerprint(layers, 4096, "bf16"))[1],
                       identity="test", fresh=False, num_slots=16, slot_bytes=8192,
                       fingerprint=shard_fingerprint(layers, 4096, "bf16"))
    for slot, job in rows.items():
        index.insert(Slots(np.array([slot])), write_tag(LEADER, job), np.array([123], np.uint64))
    index.close()


def test_restore_makes_blocks_with_every_shard_matchable_and_drops_the_rest(tmp_path: Path) -> None:
    async def scenario() -> Node:
        node = Node(tmp_path)
        await node.restore()  # first start: an empty index gets the node's fingerprint
        for i, slot in ((1, 4), (2, 5), (3, 6)):
            node.commit(i, slot, job=i)
        node.placement.registry.take_copy(node.placement.registry.entry(key(3)), DISK)  # block 3 evicted ...
        node.commit(4, 6, job=9)  # ... and its slot reused by block 4
        node.commit(5, 7, job=5)
        worker_rows(tmp_path, W0, 2, {4: 1, 5: 2, 6: 9, 7: 5})
        worker_rows(tmp_path, W1, 2, {4: 1, 5: 2, 6: 9, 7: 77})  # rank 1 rewrote slot 7 (a job never committed)
        await node.restore()  # a restart: the registry is empty, the index is read back
        return node

    node = run(scenario())
    reg = node.placement.registry
    assert sorted(k for k, e in reg.blocks.items() if e.ready_in(DISK)) == [key(1), key(2), key(4)]
    assert reg.blocks[key(4)].copies[DISK].slot == 6 and reg.blocks[key(2)].parent == key(1)
    assert reg.used(DISK) == 3
    assert reg.pools[DISK].lru.pop_victim() == key(1), "restored oldest first: the LRU order survives"
    assert [r[0] for r in node.rows()] == [key(1), key(2), key(4)], "rows that can never match are deleted"
    assert node.metrics.values["kvbm_g3_restored_blocks"] == 3
    assert node.metrics.values["kvbm_g3_discarded_blocks"] == 1
    assert node.metrics.values["kvbm_g3_index_bytes"] > 0
    assert node.membership.restoring is None and node.membership.ready
    run(node.index.close())


def test_another_layout_discards_the_index(tmp_path: Path) -> None:
    async def write_then_close() -> None:
        node = Node(tmp_path)
        await node.restore()
        node.commit(1, 0, job=1)
        await node.index.close()

    run(write_then_close())
    worker_rows(tmp_path, W0, 4, {0: 1})
    worker_rows(tmp_path, W1, 4, {0: 1})

    async def restart_with_other_layers() -> Node:
        node = Node(tmp_path, layers=4)
        await node.restore()
        return node

    node = run(restart_with_other_layers())
    assert node.placement.registry.blocks == {} and node.rows() == []
    assert node.metrics.values["kvbm_g3_discarded_blocks"] == 1
    run(node.index.close())


def test_a_reset_during_a_restore_adds_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> Node:
        node = Node(tmp_path)
        await node.restore()
        node.commit(1, 0, job=1)
        worker_rows(tmp_path, W0, 2, {0: 1})
        worker_rows(tmp_path, W1, 2, {0: 1})
        task = node.pools_ready()
        node.placement.reset()  # a worker is lost while the index is read
        node.membership.detach(W1)
        await task
        return node

    node = run(scenario())
    assert node.placement.registry.blocks == {}
    assert node.membership.restoring is None
    assert "G3 restore failed" not in caplog.text
    assert len(node.rows()) == 1, "the index keeps the block for the next restore"
    run(node.index.close())


def test_index_write_errors_are_counted_and_nothing_raises(tmp_path: Path) -> None:
    with mounted(tmp_path / "tiny", "tmpfs", "size=64k") as tiny:
        async def scenario() -> LeaderMetrics:
            node = Node(tiny)
            await node.restore()
            for i in range(2000):  # far more than 64 KiB of rows
                node.commit(i + 1, i % 16, job=i + 1)
                if i % 16 == 15:
                    await node.index.call(lambda conn: None)
            await node.index.close()
            return node.metrics

        metrics = run(scenario())
    assert metrics.values["kvbm_g3_index_errors"] > 0


def test_a_second_leader_on_the_same_index_is_refused(tmp_path: Path) -> None:
    first = G3Index(leader_index_path(str(tmp_path)), "a", LeaderMetrics())
    with pytest.raises(KvbmConfigError, match="locked by another kvbm leader"):
        G3Index(leader_index_path(str(tmp_path)), "b", LeaderMetrics())
    run(first.close())


def test_a_corrupt_index_is_replaced_by_an_empty_one(tmp_path: Path) -> None:
    path = leader_index_path(str(tmp_path))
    with open(path, "wb") as f:
        f.write(b"not a database" * 500)
    index = G3Index(path, "a", LeaderMetrics())
    assert run(index.call(lambda conn: conn.execute("SELECT count(*) FROM blocks").fetchone()[0])) == 0
    run(index.close())
