"""The leader service: the node's block metadata and the units that decide on it, built once.

Runs in the leader daemon, on its event loop. :class:`LeaderService` is the composition root:
it builds the pure core (membership, placement, sessions) and the units around it (ledger,
rebalancer, planner, fleet; see :mod:`.servicer` for which decides what), injecting the
command transport and the KV event sink it is given, so nothing is swapped after the server
serves. It also owns the periodic tick (session and job expiry, the G2 watermark), the
persistent G3 index when ``DYN_KVBM_DISK_PERSIST`` is on (:mod:`.g3_index`, :mod:`.restore`)
and the ordered shutdown.
"""
from __future__ import annotations

import logging
import time
import uuid

from kvbm_client.config import KvbmConfig
from kvbm_client.contract import pb
from kvbm_client.g3_files import leader_index_path
from kvbm_client.ids import JobId, SessionId, WorkerId
from kvbm_client.security import NodeKey

from .commands import CommandTransport
from .events import KvEventFeed, NullEvents
from .fleet import WorkerFleet
from .g3_index import G3Index
from .ledger import JobLedger, PlanSigner
from .membership import Membership
from .metrics import LeaderMetrics
from .onboard_cost import OnboardCosts
from .placement import PlacementPolicy
from .presence import PresenceFilter
from .planner import RequestPlanner
from .policies.frequency import FrequencyFilter
from .rebalancer import Rebalancer
from .refusals import Refused, Why
from .restore import G3Restorer
from .sessions import SessionLimits, SessionTable
from .status import leader_state, status_response, worker_infos

log = logging.getLogger("kvbm.leader")


def new_leader_id() -> str:
    """One leader incarnation's id (workers derive its plan key from it)."""
    return f"leader-{uuid.uuid4().hex[:12]}"


class LeaderService:
    """Owns the node's block metadata and the units that decide on it; see the module docstring.

    Args:
        config: the node configuration.
        expected_workers: the worker ids this leader plans pools over.
        node_key: the node key (plans are signed with its plan key for ``leader_id``).
        commands: how demotion and promotion commands reach the workers (gRPC or NATS).
        events: where KV events go (``NullEvents`` without NATS).
        metrics: the counters (a fresh set when not given).
        leader_id: this incarnation's id (a fresh one when not given).
        presence: the presence filter published to the clients (the daemon owns its file).
    """

    def __init__(self, config: KvbmConfig, expected_workers: list[WorkerId], node_key: NodeKey,
                 commands: CommandTransport, events: NullEvents | None = None,
                 metrics: LeaderMetrics | None = None, leader_id: str | None = None,
                 presence: PresenceFilter | None = None) -> None:
        self.config = config
        self.leader_id = leader_id or new_leader_id()
        self.metrics = metrics or LeaderMetrics()
        self.membership = Membership(config, expected_workers)
        self.frequency = FrequencyFilter(config.disk_filter_max_entries,
                                         enabled=not config.disable_disk_offload_filter)
        #: raises KvbmConfigError when another leader holds the index
        self.g3_index = G3Index(leader_index_path(config.disk_cache_dir), self.leader_id, self.metrics) \
            if config.disk_persist and config.disk_enabled else None
        self.placement = PlacementPolicy({}, self.frequency, self.g3_index)
        self.metrics.track_pools(self.placement.usage)
        #: load bandwidth per tier, learned from the jobs (see onboard_cost.py)
        self.costs = OnboardCosts(config.host_load_gbps * 1e9, config.disk_load_gbps * 1e9)
        self.metrics.track_bandwidth(self.costs.rates)
        self.sessions = SessionTable(SessionLimits(config.session_ttl_secs, config.max_session_ttl_secs,
                                                   config.max_sessions, config.max_name_bytes))
        self.feed = KvEventFeed(events or NullEvents(), presence)
        signer = PlanSigner(self.leader_id, node_key.plan_key(self.leader_id))  # workers derive the same key
        self.ledger = JobLedger(config, self.placement, self.membership, self.metrics, self.feed, signer,
                                self.costs)
        self.rebalancer = Rebalancer(config, self.placement, self.membership, self.ledger, commands, node_key,
                                     self.metrics, self.feed, self.costs)
        self.planner = RequestPlanner(self.placement, self.membership, self.ledger, self.rebalancer,
                                      self.sessions, self.feed, self.metrics, self.costs)
        self.restorer = G3Restorer(self.g3_index, self.placement, self.membership, self.feed, self.metrics) \
            if self.g3_index is not None else None
        self.fleet = WorkerFleet(config, self.leader_id, self.membership, self.placement, self.ledger,
                                 self.rebalancer, self.feed, self.metrics, self.restorer)

    @property
    def closing(self) -> bool:
        """Shutdown began: requests are answered UNAVAILABLE, lost workers are routine."""
        return self.fleet.closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self.fleet.closing = value

    # ------------------------------------------------------------------ sessions
    def open_session(self, client_name: str, ttl_ms: int) -> "pb.OpenSessionResponse":
        session = self.sessions.admit(client_name, ttl_ms, time.monotonic())
        presence = self.feed.presence
        log.info("session %s opened by %s (TTL %gs)", session.session_id[:8], session.client_name, session.ttl)
        return pb.OpenSessionResponse(session_id=session.session_id, leader_id=self.leader_id,
                                      workers=worker_infos(self.membership), max_hashes=self.config.max_hashes,
                                      ttl_ms=int(session.ttl * 1000),
                                      presence_path=presence.path if presence else "",
                                      presence_slots=presence.slots if presence else 0)

    async def close_session(self, session_id: SessionId) -> None:
        session = self.sessions.close(session_id)
        if session is not None:
            await self.ledger.end_session(session.session_id, "session closed")

    async def release(self, session: SessionId, job_id: JobId) -> None:
        job = self.ledger.jobs.get(job_id)
        if job is None or job.session != session:
            raise Refused(Why.UNKNOWN, f"no pending job {job_id} in this session")
        await self.ledger.release(job, "released by client")

    # ------------------------------------------------------------------ status
    def status(self) -> "pb.StatusResponse":
        return status_response(self.leader_id, leader_state(self.membership, self.closing), self.placement,
                               self.membership, self.metrics, len(self.sessions), len(self.ledger.jobs))

    # ------------------------------------------------------------------ background
    async def tick(self, now: float) -> None:
        """Expire sessions and jobs, keep the G2 watermark; called periodically by the daemon."""
        for session in self.sessions.pop_expired(now):
            log.warning("session %s (%s) expired: releasing its pins and jobs",
                        session.session_id[:8], session.client_name)
            await self.ledger.end_session(session.session_id, "session expired")
        await self.ledger.expire(now)
        self.feed.tick(self.placement.registry)
        self.rebalancer.maybe_demote()

    async def wait_attached(self, timeout: float) -> bool:
        return await self.fleet.wait_attached(timeout)

    async def close(self) -> None:
        """Stop taking requests, tell the workers, stop the commands in flight (idempotent;
        the transports, the event sink and the metrics server belong to whoever injected them)."""
        self.closing = True
        self.fleet.streams.shutdown("leader shutting down")
        await self.rebalancer.close()
        if self.restorer is not None:
            await self.restorer.close()
        if self.g3_index is not None:
            await self.g3_index.close()
