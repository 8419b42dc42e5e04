"""KV events for KV-aware routers: which blocks a node can serve.

Runs in the leader. The placement code calls :meth:`KvEventPublisher.stored` /
:meth:`removed` / :meth:`cleared` synchronously; they only append to a bounded buffer and
never block or fail. A background task publishes the buffer on NATS subject
``kvbm.v1.events.<node>``; when the buffer is full new events are dropped and counted in
``kvbm_kv_events_dropped`` (a router that sees a gap in ``event_id`` should resync).

Wire format (JSON, one message per placement decision):

    {"event_id": 17, "node": "host-a", "leader_id": "leader-…", "ts": 1764000000.1,
     "kind": "stored", "tier": "G2",
     "blocks": [{"block_hash": "<hex>", "parent_hash": "<hex>" | null}, …]}
    {"event_id": 18, …, "kind": "removed", "block_hashes": ["<hex>", …]}
    {"event_id": 19, …, "kind": "cleared"}        every block of the node is gone

``stored`` is sent when blocks become matchable (every worker confirmed the copy);
``removed`` when a block has no copy left in any tier (it may name a hash whose store was
rolled back before it was ever announced: routers ignore unknown hashes); ``cleared`` when a
worker was lost or the pools were re-planned. A new leader starts at ``event_id`` 1 with a
new ``leader_id``.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from typing import Any, Iterable

from kvbm_client.bus import NatsBus
from kvbm_client.ids import BlockHash, Tier

from .metrics import LeaderMetrics
from .presence import PresenceFilter
from .registry import BlockRegistry

log = logging.getLogger("kvbm.leader")
MAX_BATCH = 256  # events flushed per wake-up
MAX_BLOCKS_PER_EVENT = 1024  # a big job is announced in several events (bounded JSON work each)


class NullEvents:
    """No router to tell (no NATS): every call is a no-op."""

    def stored(self, blocks: Iterable[tuple[BlockHash, BlockHash | None]], tier: Tier) -> None:
        pass

    def removed(self, keys: Iterable[BlockHash]) -> None:
        pass

    def cleared(self) -> None:
        pass

    async def close(self) -> None:
        pass


class KvEventPublisher(NullEvents):
    """Owns the bounded event buffer and the task that drains it to NATS."""

    def __init__(self, bus: NatsBus, subject: str, node: str, leader_id: str, capacity: int,
                 metrics: LeaderMetrics) -> None:
        self.bus = bus
        self.subject = subject
        self.node = node
        self.leader_id = leader_id
        self.capacity = capacity
        self.metrics = metrics
        self._buffer: collections.deque[dict[str, Any]] = collections.deque()
        self._wake = asyncio.Event()
        self._next_id = 1
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # ------------------------------------------------------------------ producers (sync)
    def _push(self, event: dict[str, Any]) -> None:
        if self._closed:
            return
        event_id, self._next_id = self._next_id, self._next_id + 1  # a drop leaves a gap in the ids
        if len(self._buffer) >= self.capacity:
            self.metrics.inc("kvbm_kv_events_dropped")
            return
        event.update(event_id=event_id, node=self.node, leader_id=self.leader_id, ts=time.time())
        self._buffer.append(event)
        self._wake.set()

    def stored(self, blocks: Iterable[tuple[BlockHash, BlockHash | None]], tier: Tier) -> None:
        out = [{"block_hash": k.hex(), "parent_hash": p.hex() if p else None} for k, p in blocks]
        for i in range(0, len(out), MAX_BLOCKS_PER_EVENT):
            self._push({"kind": "stored", "tier": tier.label, "blocks": out[i:i + MAX_BLOCKS_PER_EVENT]})

    def removed(self, keys: Iterable[BlockHash]) -> None:
        out = [k.hex() for k in keys]
        for i in range(0, len(out), MAX_BLOCKS_PER_EVENT):
            self._push({"kind": "removed", "block_hashes": out[i:i + MAX_BLOCKS_PER_EVENT]})

    def cleared(self) -> None:
        self._push({"kind": "cleared"})

    # ------------------------------------------------------------------ publisher task
    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("KvEventPublisher.start() called twice")
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._buffer:
                nc = self.bus.nc
                if nc is None or not self.bus.is_connected:
                    await asyncio.sleep(0.05)  # events wait in the buffer; producers never do
                    continue
                for _ in range(min(MAX_BATCH, len(self._buffer))):
                    event = self._buffer[0]
                    try:
                        await nc.publish(self.subject, json.dumps(event).encode())
                    except Exception as exc:  # the connection dropped under us: retry later
                        log.debug("event publish failed: %s", exc)
                        break
                    self._buffer.popleft()
                    self.metrics.inc("kvbm_kv_events_published")
                await asyncio.sleep(0)

    async def close(self) -> None:
        if self._closed:
            return
        if self._task is not None and self.bus.is_connected:
            end = time.monotonic() + 1.0  # best effort: flush what is buffered
            while self._buffer and time.monotonic() < end:
                await asyncio.sleep(0.01)
        self._closed = True
        if self._task is not None:
            self._task.cancel()


class KvEventFeed:
    """What the routers are told, derived from the registry: the one place that turns block
    changes into KV events. Runs in the leader, synchronously.

    NOTE: removals are journaled by the registry (a block forgotten by an eviction, a
    rollback, a corrupt copy, a demotion); :meth:`flush` sends them. Every unit that changes
    the registry calls it once its change is done (the planner after a store, the ledger
    after a settle, the rebalancer after a demotion, the tick), so no removal waits for an
    unrelated request.
    """

    def __init__(self, events: NullEvents, presence: PresenceFilter | None = None) -> None:
        self.events = events
        #: the clients' presence filter: told here of every block planned, restored or forgotten
        self.presence = presence

    def flush(self, registry: BlockRegistry) -> None:
        """Announce the blocks forgotten since the last flush."""
        forgotten = registry.take_forgotten()
        if forgotten:
            self.events.removed(forgotten)
        if self.presence is not None:
            self.presence.gone(len(forgotten))

    def tick(self, registry: BlockRegistry) -> None:
        """The leader's periodic tick: flush, and advance the presence filter's rebuild."""
        self.flush(registry)
        if self.presence is not None:
            self.presence.step(registry.parents)

    def stored(self, registry: BlockRegistry, ready: list[tuple[BlockHash, Tier]]) -> None:
        """Flush, then announce ``ready`` (blocks a store just made matchable), per tier."""
        self.flush(registry)
        by_tier: dict[Tier, list[tuple[BlockHash, BlockHash | None]]] = {}
        for key, tier in ready:
            pool = registry.pools.get(tier)
            if pool is not None and key in pool.ready:
                by_tier.setdefault(tier, []).append((key, registry.parents.get(key)))
        for tier, blocks in by_tier.items():
            self.events.stored(blocks, tier)

    def planned(self, keys: list[BlockHash]) -> None:
        """A store plan reserved copies of ``keys``: the presence filter takes them now, before
        any of them can be matched (a job's copies become ready a slice at a time)."""
        if self.presence is not None and keys:
            self.presence.add(keys)

    def restored(self, blocks: list[tuple[BlockHash, BlockHash | None]]) -> None:
        """``blocks`` (hash, parent) were added to G3, ready, from a persisted index."""
        if self.presence is not None:
            self.presence.add([key for key, _ in blocks])
        self.events.stored(blocks, Tier.DISK)

    def cleared(self) -> None:
        if self.presence is not None:
            self.presence.clear()
        self.events.cleared()
