"""Leader metrics, under Dynamo KVBM's names, served on ``DYN_KVBM_METRICS_PORT``.

NOTE: the eight seed names are exported exactly as Dynamo spells them (no ``_total``
suffix, which prometheus-client adds to counter types), so dashboards built for Dynamo
work unchanged; the offload/onboard/matched series are monotonic (use ``rate()``).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvbm_client.ids import Tier

COUNTERS = {
    "kvbm_matched_tokens": "Number of matched tokens",
    "kvbm_offload_blocks_d2h": "Offload blocks from device to host",
    "kvbm_offload_blocks_h2d": "Offload blocks from host to disk",
    "kvbm_offload_blocks_d2d": "Offload blocks from device to disk (bypassing host)",
    "kvbm_onboard_blocks_h2d": "Onboard blocks from host to device",
    "kvbm_onboard_blocks_d2d": "Onboard blocks from disk to device",
    "kvbm_offload_skipped_present": "Offload requests skipped: block already stored",
    "kvbm_offload_skipped_full": "Offload requests skipped: target pool full or not ready",
    "kvbm_evicted_blocks": "Blocks dropped from the cache by eviction",
    "kvbm_offload_skipped_demotions": "Evicted G2 blocks worth G3 that an offload dropped instead of writing them "
                                      "to G3 first (DYN_KVBM_STORE_DEMOTION_MB spent)",
    "kvbm_promoted_blocks": "Blocks copied back from disk to host after a disk hit",
    "kvbm_onboard_skipped_blocks": "Matched blocks not loaded because recomputing them was expected to be faster",
    "kvbm_failed_jobs": "Transfer jobs rolled back (worker failure, timeout, release)",
    "kvbm_lost_blocks": "Blocks dropped because a worker's pools were lost",
    "kvbm_kv_events_published": "KV events published on NATS (kvbm.v1.events.<node>)",
    "kvbm_kv_events_dropped": "KV events dropped because the event buffer was full",
    "kvbm_commands_undelivered": "Leader commands to workers without an acknowledgement (left to expire)",
    "kvbm_corrupt_blocks": "Block copies dropped because a worker found their bytes bad (checksum, short read)",
    "kvbm_g3_restored_blocks": "G3 blocks made matchable again from the persistent index (DYN_KVBM_DISK_PERSIST)",
    "kvbm_g3_discarded_blocks": "G3 index entries discarded at restore (other layout, a rank's shard missing or "
                                "rewritten, outside the G3 size)",
    "kvbm_g3_index_errors": "Batches of G3 index changes the leader could not write (full disk, I/O error)",
    "kvbm_presence_filter_misses": "Looked-up blocks that clients answered as misses on the presence filter's word, "
                                   "without asking (counted in the hit rates too)",
}
#: Levels, set by their owner (not monotonic).
GAUGES = {
    "kvbm_g3_index_bytes": "Bytes of the persistent G3 index: the leader's and the workers' files, WAL included",
}

#: Onboard decisions by reason (``kvbm_onboard_decisions{reason}``, :class:`~.onboard_cost.OnboardReason`).
ONBOARD_REASONS = ("load", "partial", "recompute", "unchecked")

PoolUsage = Callable[[], "dict[Tier, tuple[int, int, int]]"]
Bandwidth = Callable[[], "dict[Tier, float]"]


@dataclass
class HitWindow:
    """Sliding window over the last ``size`` lookups (in blocks)."""

    size: int = 1024
    _samples: collections.deque[tuple[int, int, int]] = field(default_factory=lambda: collections.deque(maxlen=1024))

    def add(self, queried: int, host: int, disk: int) -> None:
        if queried:
            self._samples.append((queried, host, disk))

    def rates(self) -> tuple[float, float]:
        queried = sum(s[0] for s in self._samples)
        if not queried:
            return 0.0, 0.0
        return (sum(s[1] for s in self._samples) / queried, sum(s[2] for s in self._samples) / queried)


class LeaderMetrics(Collector):
    """Counters kept by the leader plus gauges read at scrape time from the pool usage source
    (:meth:`track_pools`, set once by the service; read on the HTTP server's thread, so it
    must be O(1) and only read plain counters)."""

    def __init__(self, pool_usage: PoolUsage | None = None) -> None:
        self.values: dict[str, float] = dict.fromkeys((*COUNTERS, *GAUGES), 0.0)
        self.hits = HitWindow()
        self.onboard_decisions: dict[str, float] = dict.fromkeys(ONBOARD_REASONS, 0.0)
        self._pool_usage: PoolUsage = pool_usage or dict
        self._bandwidth: Bandwidth = dict
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server: Any = None

    def track_pools(self, pool_usage: PoolUsage) -> None:
        self._pool_usage = pool_usage

    def track_bandwidth(self, bandwidth: Bandwidth) -> None:
        """The source of the per-tier load bandwidth estimates (read at scrape time)."""
        self._bandwidth = bandwidth

    def inc(self, name: str, amount: float = 1.0) -> None:
        self.values[name] += amount

    def count_onboard(self, reason: str, skipped: int) -> None:
        """One onboard decision (its reason) and the matched blocks it left to recompute."""
        self.onboard_decisions[reason] += 1
        self.values["kvbm_onboard_skipped_blocks"] += skipped

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, doc in (*COUNTERS.items(), *GAUGES.items()):
            yield GaugeMetricFamily(name, doc, value=self.values[name])
        host, disk = self.hits.rates()
        yield GaugeMetricFamily("kvbm_host_cache_hit_rate", "Host cache hit rate (0.0-1.0)", value=host)
        yield GaugeMetricFamily("kvbm_disk_cache_hit_rate", "Disk cache hit rate (0.0-1.0)", value=disk)
        cap = GaugeMetricFamily("kvbm_pool_capacity_blocks", "Blocks a tier can hold", labels=["tier"])
        used = GaugeMetricFamily("kvbm_pool_used_blocks", "Blocks held (ready or pending)", labels=["tier"])
        pinned = GaugeMetricFamily("kvbm_pool_pinned_blocks", "Blocks pinned by loads", labels=["tier"])
        for tier, (c, u, p) in self._pool_usage().items():
            cap.add_metric([tier.label], c)
            used.add_metric([tier.label], u)
            pinned.add_metric([tier.label], p)
        yield cap
        yield used
        yield pinned
        decisions = GaugeMetricFamily("kvbm_onboard_decisions", "Onboard decisions on a matched prefix, by reason "
                                      "(load all, partial, recompute, unchecked: no estimate)", labels=["reason"])
        for reason, count in self.onboard_decisions.items():
            decisions.add_metric([reason], count)
        yield decisions
        bandwidth = GaugeMetricFamily("kvbm_load_bandwidth_bytes_per_second",
                                      "Estimated load bandwidth per worker (prior until measured)", labels=["tier"])
        for tier, rate in self._bandwidth().items():
            bandwidth.add_metric([tier.label], rate)
        yield bandwidth

    def serve(self, port: int, addr: str) -> None:
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
