"""G3 restore: when the node's pools are ready, the blocks of the persistent G3 index whose
every shard is still on disk become matchable again (``DYN_KVBM_DISK_PERSIST``).

Runs in the leader: :class:`G3Restorer` on the event loop, the reads on the index's writer
thread (:meth:`~.g3_index.G3Index.call`). Who knows what: the leader's block index knows each
block's slot and the job that wrote it (its *write tag*); each worker's shard index knows, for
every slot of its G3 file, the tag of the last write that finished and is durable (a worker
deletes a slot's row durably before it overwrites the slot). So a block is restored only if

* the node's layout fingerprint (every worker's id, rank, layers, page bytes, dtype) is the
  one the index was written under (else every row is discarded, with one log line), and
* its slot lies in the current G3, and
* EVERY rank's shard index has a row for that slot with the block's tag (a rank whose index
  is missing, of another layout or not reported restores nothing).

Rows that fail are deleted from the index (they can never match again) and counted in
``kvbm_g3_discarded_blocks``; the others are added to the registry as ready G3 copies, in
index order (oldest first, so the LRU keeps its order), a slice at a time, and counted in
``kvbm_g3_restored_blocks``. Bytes are verified as for any G3 read: a slot whose checksum
fails when loaded is dropped and counted in ``kvbm_corrupt_blocks``, never served.

While a restore runs the node is not ready (``Membership.restoring``): no store can take a
slot the restore is about to claim. A reset (a worker lost, a re-plan) makes a running
restore stop; the next ready epoch restores again.
"""
from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from kvbm_client.g3_files import (ShardSource, join, node_fingerprint, read_meta, read_shard_tags, shard_fingerprint,
                                  transaction, write_meta)
from kvbm_client.ids import BlockHash, SlotId, Tier, WorkerId

from .events import KvEventFeed
from .g3_index import G3Index
from .membership import Membership
from .metrics import LeaderMetrics
from .placement import PlacementPolicy

log = logging.getLogger("kvbm.leader")
SLICE = 4096  # blocks added to the registry between two yields to the event loop


@dataclass(slots=True)
class Restorable:
    """What the index holds that may be restored, and what was discarded (and why)."""

    keys: list[BlockHash] = field(default_factory=list)
    parents: list[BlockHash | None] = field(default_factory=list)
    slots: list[SlotId] = field(default_factory=list)
    why: dict[str, int] = field(default_factory=dict)

    @property
    def discarded(self) -> int:
        return sum(self.why.values())


def read_restorable(conn: sqlite3.Connection, fingerprint: str, num_slots: int,
                    shards: Mapping[WorkerId, ShardSource]) -> Restorable:
    """(On the index's writer thread.) The restorable rows; every other row is deleted."""
    old = read_meta(conn).get("fingerprint")
    out = Restorable()
    if old != fingerprint:
        total = conn.execute("SELECT count(*) FROM blocks").fetchone()[0]
        with transaction(conn):
            conn.execute("DELETE FROM blocks")
            write_meta(conn, {"fingerprint": fingerprint})
        if total:
            out.why[f"engine layout changed ({old} -> {fingerprint})"] = total
        return out
    rows = conn.execute("SELECT rowid, key, parent, slot, tag FROM blocks ORDER BY rowid").fetchall()
    ids = np.array([(r[0], r[3], r[4]) for r in rows], np.int64).reshape(-1, 3)
    tags = {w: read_shard_tags(w, s, num_slots) for w, s in shards.items()}
    keep, out.why = join(ids[:, 1], ids[:, 2], num_slots, tags)
    gone = ids[~keep, 0].tolist()
    if gone:
        with transaction(conn):
            conn.executemany("DELETE FROM blocks WHERE rowid = ?", ((r,) for r in gone))
    for i in np.nonzero(keep)[0].tolist():
        _, key, parent, slot, _ = rows[i]
        out.keys.append(BlockHash(key))
        out.parents.append(BlockHash(parent) if parent is not None else None)
        out.slots.append(SlotId(slot))
    return out


class G3Restorer:
    """Runs the restore of each ready pool epoch (see the module docstring). Owns the shard
    index paths the workers reported and the restore task; borrows the rest."""

    def __init__(self, index: G3Index, placement: PlacementPolicy, membership: Membership, feed: KvEventFeed,
                 metrics: LeaderMetrics) -> None:
        self.index, self.placement, self.membership = index, placement, membership
        self.feed, self.metrics = feed, metrics
        self.shards: dict[WorkerId, str] = {}
        self._restored_epoch = -1
        self._task: asyncio.Task[None] | None = None

    def pools_ready(self, worker_id: WorkerId, disk_index: str) -> None:
        """A worker allocated the current pools; its shard index is at ``disk_index``."""
        self.shards[worker_id] = disk_index
        self.index.sized_with = tuple(sorted(p for p in self.shards.values() if p))
        m = self.membership
        if not m.pools_ready or m.pools is None or m.pools.epoch == self._restored_epoch:
            return
        if self._task is not None:
            self._task.cancel()  # a restore of an older epoch: its registry is gone
        epoch = self._restored_epoch = m.restoring = m.pools.epoch
        node, sources = self._sources()
        self._task = asyncio.ensure_future(self._restore(epoch, self.placement.generation, node, sources,
                                                         m.pools.disk_slots))

    def _sources(self) -> tuple[str, dict[WorkerId, ShardSource]]:
        layouts = {w: r.layout for w in self.membership.members
                   if (r := self.membership.workers.get(w)) is not None and r.layout is not None}
        prints = {w: shard_fingerprint(lay.num_layers, lay.page_bytes, lay.dtype) for w, lay in layouts.items()}
        node = node_fingerprint((w, lay.rank, prints[w]) for w, lay in layouts.items())
        return node, {w: ShardSource(self.shards.get(w, ""), prints[w]) for w in layouts}

    async def _restore(self, epoch: int, generation: int, node: str, sources: dict[WorkerId, ShardSource],
                       num_slots: int) -> None:
        """Restore pool epoch ``epoch`` into the registry of placement ``generation`` (``node``:
        the layout fingerprint; ``sources``: every member's shard index)."""
        started = time.perf_counter()
        try:
            found = await self.index.call(lambda conn: read_restorable(conn, node, num_slots, sources))
            if self.placement.generation != generation:
                return  # reset meanwhile: the next ready epoch restores again
            restored = await self._apply(found, generation)
            self.metrics.inc("kvbm_g3_restored_blocks", restored)
            self.metrics.inc("kvbm_g3_discarded_blocks", found.discarded)
            await self.index.call(self.index.size_now)
            log.log(logging.WARNING if found.discarded else logging.INFO,
                    "G3 restored from the persistent index: %d blocks matchable again, %d discarded%s in %.2f s",
                    restored, found.discarded, " (" + "; ".join(f"{n}: {w}" for w, n in found.why.items()) + ")"
                    if found.why else "", time.perf_counter() - started)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("G3 restore failed; G3 starts empty")
        finally:
            if self.membership.restoring == epoch:
                self.membership.restoring = None

    async def _apply(self, found: Restorable, generation: int) -> int:
        """Ready G3 copies for the restorable rows, a slice at a time; returns how many."""
        reg = self.placement.registry
        pool = reg.pools.get(Tier.DISK)
        if pool is None or not found.keys:
            return 0
        rows = [i for i, k in enumerate(found.keys) if k not in reg.parents]
        taken = pool.allocator.reserve(found.slots[i] for i in rows)
        rows = [i for i in rows if found.slots[i] in taken]
        for start in range(0, len(rows), SLICE):
            if start:
                await asyncio.sleep(0)
                if self.placement.generation != generation:
                    return start  # the registry was replaced: nothing more to add
            blocks = []
            for i in rows[start:start + SLICE]:
                key, parent = found.keys[i], found.parents[i]
                reg.add_copy_key(key, parent, Tier.DISK, found.slots[i], None)
                blocks.append((key, parent))
            self.feed.restored(blocks)  # just added, all ready: no registry pass
        return len(rows)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
