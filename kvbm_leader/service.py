"""The leader's gRPC service: validates every request, then applies the pure placement
policy and turns its decisions into signed plans.

Runs in the leader daemon, on its event loop; nothing here blocks.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Awaitable

import grpc

from kvbm_client.config import KvbmConfig
from kvbm_client.contract import MatchResult, pb, rpc, sign_plan
from kvbm_client.ids import MAX_HASH_BYTES, BlockHash, JobId, PlanKind, SessionId, Tier, WorkerId
from kvbm_client.security import NodeKey, ack_is_authentic

from .commands import create as create_commands
from .events import NullEvents
from .jobs import Job, JobState, JobTable, StartRefused
from .membership import Layout, Membership, WorkerRecord
from .metrics import LeaderMetrics
from .placement import JobPlan, Outcome, TierManager
from .policies.frequency import FrequencyFilter
from .sessions import SessionTable

log = logging.getLogger("kvbm.leader")


def _short(keys: list[BlockHash], n: int = 3) -> str:
    head = ",".join(k.hex()[:12] for k in keys[:n])
    return head + (f",…(+{len(keys) - n})" if len(keys) > n else "")


class LeaderService(rpc.LeaderServicer):
    """Owns the node's block metadata; see the module docstring of :mod:`.placement`."""

    def __init__(self, config: KvbmConfig, expected_workers: list[WorkerId], node_key: NodeKey) -> None:
        self.config = config
        self.leader_id = f"leader-{uuid.uuid4().hex[:12]}"
        self.node_key = node_key
        self.secret = node_key.plan_key(self.leader_id)  # workers derive the same key; none travels
        self.membership = Membership(config, expected_workers)
        self.frequency = FrequencyFilter(config.disk_filter_max_entries,
                                         enabled=not config.disable_disk_offload_filter)
        self.tiers = TierManager({}, self.frequency)
        self.jobs = JobTable()
        self.sessions = SessionTable()
        self.metrics = LeaderMetrics(self._pool_usage)
        self.closing = False
        self._events: dict[WorkerId, asyncio.Queue] = {}
        # kvbm_leader/cluster.py swaps in NATS when configured
        self.commands = create_commands("grpc", config=config, node_key=node_key)
        self.events = NullEvents()  # KV events for routers; a KvEventPublisher with NATS
        self._attached = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._demotion_in_flight = False
        self._promotion_in_flight = False

    # ------------------------------------------------------------------ helpers
    @property
    def grace(self) -> float:
        return self.config.job_timeout_secs

    def _pool_usage(self) -> dict[Tier, tuple[int, int, int]]:
        reg = self.tiers.registry
        return {t: (p.capacity, p.allocator.num_used, reg.count_pinned(t)) for t, p in reg.pools.items()}

    async def _guard(self, context: grpc.aio.ServicerContext) -> None:
        if self.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "leader is shutting down")

    async def _session(self, session_id: str, context) -> SessionId:
        await self._guard(context)
        if not self.sessions.renew(SessionId(session_id), time.monotonic()):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown or expired session {session_id!r}; open a new one")
        return SessionId(session_id)

    async def _hashes(self, hashes, context, what: str = "hashes") -> list[BlockHash]:
        if len(hashes) > self.config.max_hashes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(hashes)} {what} in one request; at most {self.config.max_hashes}")
        keys: list[BlockHash] = list(hashes)  # protobuf hands out bytes objects already
        if keys and not (0 < min(map(len, keys)) and max(map(len, keys)) <= MAX_HASH_BYTES):
            i, h = next((i, h) for i, h in enumerate(keys) if not 0 < len(h) <= MAX_HASH_BYTES)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{what}[{i}] has {len(h)} bytes; 1..{MAX_HASH_BYTES} allowed")
        return keys

    async def _worker(self, worker_id: str, context) -> WorkerRecord:
        record = self.membership.workers.get(WorkerId(worker_id))
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown worker {worker_id!r} (not attached)")
        return record

    def _worker_infos(self) -> list:
        plan = self.membership.plan
        epoch = plan.epoch if plan else -1
        out = []
        for rec in sorted(self.membership.workers.values(), key=lambda r: r.rank):
            info = pb.WorkerInfo(worker_id=rec.worker_id, rank=rec.rank, endpoint=rec.endpoint,
                                 state=rec.state(epoch), alloc_progress=rec.alloc_progress)
            if rec.layout is not None:
                lay = rec.layout
                info.layout.CopyFrom(pb.KvLayout(num_layers=lay.num_layers, page_bytes=lay.page_bytes,
                                                 dtype=lay.dtype, num_engine_blocks=lay.num_engine_blocks,
                                                 rank=lay.rank))
                if plan is not None:
                    info.host_bytes = plan.host_slots * lay.block_bytes
                    info.disk_bytes = plan.disk_slots * lay.block_bytes
            out.append(info)
        return out

    def _new_job(self, plan: JobPlan, session: SessionId | None) -> tuple[Job, pb.SignedPlan]:
        now = time.monotonic()
        deadline = now + self.config.job_timeout_secs
        job = Job(plan, session, deadline, deadline + self.grace, frozenset(self.membership.expected))
        self.jobs.add(job)
        wire = pb.TransferPlan(job_id=plan.job_id, kind=int(plan.kind), tiers=[int(t) for t in plan.tiers],
                               slots=plan.slots, deadline=deadline, epoch=self.membership.plan.epoch,
                               leader_id=self.leader_id,
                               demote_host_slots=[d.host_slot for d in plan.demotions],
                               demote_disk_slots=[d.disk_slot for d in plan.demotions],
                               promote_host_slots=[d.host_slot for d in plan.promotions],
                               promote_disk_slots=[d.disk_slot for d in plan.promotions])
        return job, sign_plan(wire, self.secret)

    def _settle(self, job: Job, success: bool, why: str = "") -> Outcome:
        """Commit or roll back a job and count what it did."""
        self.jobs.pop(job.job_id)
        outcome = self.tiers.complete(job.plan, success)
        self._announce(job.plan if success else None)
        m = self.metrics
        m.inc("kvbm_offload_blocks_d2h", outcome.stored[Tier.HOST])
        m.inc("kvbm_offload_blocks_d2d", outcome.stored[Tier.DISK])
        m.inc("kvbm_offload_blocks_h2d", outcome.demoted)
        m.inc("kvbm_onboard_blocks_h2d", outcome.loaded[Tier.HOST])
        m.inc("kvbm_onboard_blocks_d2d", outcome.loaded[Tier.DISK])
        m.inc("kvbm_promoted_blocks", outcome.promoted)
        if not success:
            m.inc("kvbm_failed_jobs")
        log.debug("%s job=%d %s: %d blocks, %d demotions%s", job.plan.kind.name.lower(), job.job_id,
                  "committed" if success else "rolled back", len(job.plan.keys), len(job.plan.demotions),
                  f" ({why})" if why else "")
        return outcome

    def _announce(self, plan: JobPlan | None = None) -> None:
        """KV events: blocks forgotten since the last call, then the blocks ``plan`` made matchable."""
        reg = self.tiers.registry
        self.events.removed(reg.take_forgotten())
        if plan is not None and plan.kind is PlanKind.STORE and plan.keys:
            ready = [(k, reg.blocks[k].parent) for k, t in zip(plan.keys, plan.tiers)
                     if k in reg.blocks and reg.blocks[k].ready_in(t)]
            self.events.stored(ready, plan.tiers[0])

    # ------------------------------------------------------------------ clients
    async def OpenSession(self, request, context):
        await self._guard(context)
        ttl = request.ttl_ms / 1000 if request.ttl_ms else self.config.session_ttl_secs
        session = self.sessions.open(request.client_name or "anonymous", ttl, time.monotonic())
        log.info("session %s opened by %s", session.session_id[:8], session.client_name)
        return pb.OpenSessionResponse(session_id=session.session_id, leader_id=self.leader_id,
                                      workers=self._worker_infos(), max_hashes=self.config.max_hashes,
                                      ttl_ms=int(ttl * 1000))

    async def KeepAlive(self, request, context):
        await self._session(request.session_id, context)
        return pb.KeepAliveResponse(ready=self.membership.ready)

    async def CloseSession(self, request, context):
        session = self.sessions.close(SessionId(request.session_id))
        if session is not None:
            self._end_session_jobs(session.session_id, "session closed")
        return pb.CloseSessionResponse()

    async def Match(self, request, context):
        await self._session(request.session_id, context)
        keys = await self._hashes(request.hashes, context)
        if not self.membership.ready:
            return pb.MatchResponse(num_matched=0)
        result = self.tiers.match(keys, request.count_hit)
        if request.count_hit:
            self._count_lookup(keys, result, request.tokens_per_block)
        log.debug("match: %d/%d blocks [%s]", result.num_matched, len(keys),
                  ",".join(t.label for t in result.tiers[:8]))
        return pb.MatchResponse(num_matched=result.num_matched, tiers=[int(t) for t in result.tiers])

    def _count_lookup(self, keys: list[BlockHash], result, tokens_per_block: int) -> None:
        host = sum(1 for t in result.tiers if t is Tier.HOST)
        self.metrics.hits.add(len(keys), host, result.num_matched - host)
        self.metrics.inc("kvbm_matched_tokens", result.num_matched * (tokens_per_block or 1))

    async def PrepareStore(self, request, context):
        session = await self._session(request.session_id, context)
        keys = await self._hashes(request.hashes, context)
        parents = await self._hashes(request.parent_hashes, context, "parent_hashes") if request.parent_hashes else None
        if parents is not None and len(parents) != len(keys):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(parents)} parent_hashes for {len(keys)} hashes")
        if not self.membership.ready:
            self.metrics.inc("kvbm_offload_skipped_full", len(keys))
            log.debug("offload skipped: %d blocks, pools not ready", len(keys))
            return pb.PrepareStoreResponse(skipped_full=len(keys))
        plan = self.tiers.prepare_store(self.jobs.next_id(), keys, parents)
        self.metrics.inc("kvbm_offload_skipped_present", plan.skipped_present)
        self.metrics.inc("kvbm_offload_skipped_full", plan.skipped_full)
        self.metrics.inc("kvbm_evicted_blocks", plan.dropped)
        resp = pb.PrepareStoreResponse(skipped_present=plan.skipped_present, skipped_full=plan.skipped_full)
        if not plan.is_empty:
            _, signed = self._new_job(plan, session)
            resp.plan.CopyFrom(signed)
            resp.indices.extend(plan.indices)
        log.debug("offload decision job=%d: store %d to %s [%s], present %d, full %d, demote %d, dropped %d",
                  plan.job_id, len(plan.keys), plan.tiers[0].label if plan.tiers else "-", _short(plan.keys),
                  plan.skipped_present, plan.skipped_full, len(plan.demotions), plan.dropped)
        self._maybe_demote()
        return resp

    async def PrepareLoad(self, request, context):
        session = await self._session(request.session_id, context)
        keys = await self._hashes(request.hashes, context)
        if not self.membership.ready:
            return pb.PrepareLoadResponse(num_planned=0)
        plan = self.tiers.prepare_load(self.jobs.next_id(), keys)
        if request.count_hit:  # the same prefix a match would find: count it without a second pass
            self.frequency.hit_many(plan.keys)
            self._count_lookup(keys, MatchResult(len(plan.keys), tuple(plan.tiers)), request.tokens_per_block)
        resp = pb.PrepareLoadResponse(num_planned=len(plan.keys))
        if plan.keys:
            _, signed = self._new_job(plan, session)
            resp.plan.CopyFrom(signed)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("onboard decision job=%d: load %d/%d [%s] from %s", plan.job_id, len(plan.keys), len(keys),
                      _short(plan.keys), ",".join(sorted({t.label for t in set(plan.tiers)})) or "-")
        self._maybe_promote([k for k, t in zip(plan.keys, plan.tiers) if t is Tier.DISK])
        return resp

    def _maybe_promote(self, keys: list[BlockHash]) -> None:
        """After a G3 hit, copy the blocks back to G2 (one promotion job in flight at a time)."""
        if not keys or self._promotion_in_flight:
            return
        plan = self.tiers.prepare_promotion(self.jobs.next_id(), keys)
        self.metrics.inc("kvbm_evicted_blocks", plan.dropped)
        if plan.promotions:
            job, signed = self._new_job(plan, None)
            log.debug("promotion decision job=%d: G3->G2 %d blocks, demote %d, dropped %d", job.job_id,
                      len(plan.promotions), len(plan.demotions), plan.dropped)
            self._promotion_in_flight = True
            self._spawn(self._send_command(job, signed, "_promotion_in_flight"))

    async def Release(self, request, context):
        session = await self._session(request.session_id, context)
        job = self.jobs.get(JobId(request.job_id))
        if job is None or job.session != session:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pending job {request.job_id} in this session")
        self._release(job, "released by client")
        return pb.ReleaseResponse()

    def _release(self, job: Job, why: str) -> None:
        # A load no worker was told to start only needs its pins back; slots a worker may still
        # read or write (a started job, a store, a demotion) stay reserved until every started
        # worker reported or the job expires.
        if job.plan.kind is PlanKind.LOAD and not job.reported and not job.started:
            self._settle(job, False, why)
        else:
            self.jobs.fail(job.job_id, why)

    def _end_session_jobs(self, session: SessionId, why: str) -> None:
        for job in self.jobs.of_session(session):
            if job.state is JobState.PENDING:
                self._release(job, why)

    # ------------------------------------------------------------------ workers
    async def Attach(self, request, context):
        await self._guard(context)
        worker_id = WorkerId(request.worker_id)
        record = WorkerRecord(worker_id, request.rank, request.endpoint, request.pid, request.cuda)
        try:
            self.membership.attach(record)
        except KeyError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc.args[0]))
        except LookupError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        queue: asyncio.Queue = asyncio.Queue()
        self._events[worker_id] = queue
        log.info("worker %s attached (rank %d, pid %d, %s)", worker_id, record.rank, record.pid, record.endpoint)
        if self.membership.all_attached:
            self._attached.set()
        try:
            yield pb.LeaderEvent(welcome=pb.Welcome(leader_id=self.leader_id,
                                                    job_timeout_s=self.config.job_timeout_secs))
            while True:
                event = await queue.get()
                if event is None:
                    return
                yield event
        finally:
            self._events.pop(worker_id, None)
            if self.membership.workers.get(worker_id) is record:
                self._worker_lost(worker_id, "attach stream ended")

    def _worker_lost(self, worker_id: WorkerId, why: str) -> None:
        self.membership.detach(worker_id)
        self._attached.clear()
        self.commands.forget(worker_id)
        for job in self.jobs.clear():
            self.tiers.complete(job.plan, False)
            self.metrics.inc("kvbm_failed_jobs")
        lost = self.tiers.reset()
        self.events.cleared()
        self.metrics.inc("kvbm_lost_blocks", lost)
        if not self.closing:  # a worker stopping while it holds nothing is routine, not a warning
            log.log(logging.WARNING if lost else logging.INFO,
                    "worker %s detached (%s): %d blocks are no longer matchable", worker_id, why, lost)

    async def SetLayout(self, request, context):
        await self._guard(context)
        record = await self._worker(request.worker_id, context)
        lay = request.layout
        if lay.num_layers == 0 or lay.page_bytes == 0 or lay.num_engine_blocks == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "layout needs num_layers, page_bytes and num_engine_blocks > 0")
        layout = Layout(lay.num_layers, lay.page_bytes, lay.dtype, lay.num_engine_blocks, record.rank)
        if self.membership.set_layout(record.worker_id, layout):
            self._replan()
        else:
            log.info("worker %s re-registered the same layout; keeping %d blocks", record.worker_id,
                     len(self.tiers.registry.blocks))
            plan = self.membership.plan
            if plan is not None:
                self._events[record.worker_id].put_nowait(pb.LeaderEvent(pools=pb.PoolPlan(
                    epoch=plan.epoch, host_slots=plan.host_slots, disk_slots=plan.disk_slots)))
        return pb.SetLayoutResponse()

    def _replan(self) -> None:
        for job in self.jobs.clear():
            self.tiers.complete(job.plan, False)
        dropped = self.tiers.reset()
        self.events.cleared()
        plan = self.membership.replan()
        if plan is None:
            log.info("waiting for the layouts of %s", ", ".join(
                w for w in self.membership.expected
                if w not in self.membership.workers or self.membership.workers[w].layout is None))
            return
        self.tiers = TierManager({Tier.HOST: plan.host_slots, Tier.DISK: plan.disk_slots}, self.frequency)
        log.info("pool plan epoch %d: G2 %d blocks, G3 %d blocks (%d bytes per block over %d workers)%s",
                 plan.epoch, plan.host_slots, plan.disk_slots, self.membership.block_bytes(),
                 len(self.membership.expected), f"; dropped {dropped} blocks" if dropped else "")
        event = pb.LeaderEvent(pools=pb.PoolPlan(epoch=plan.epoch, host_slots=plan.host_slots,
                                                  disk_slots=plan.disk_slots))
        for queue in self._events.values():
            queue.put_nowait(event)

    async def PoolsReady(self, request, context):
        record = await self._worker(request.worker_id, context)
        plan = self.membership.plan
        if plan is None or request.epoch != plan.epoch:
            return pb.PoolsReadyResponse()  # stale: a newer plan is on its way
        if not request.ok:
            record.error = request.error
            log.error("worker %s could not allocate its pools: %s", record.worker_id, request.error)
            return pb.PoolsReadyResponse()
        record.ready_epoch, record.alloc_progress, record.error = plan.epoch, 1.0, ""
        log.info("worker %s pools ready (epoch %d)%s", record.worker_id, plan.epoch,
                 "; node ready" if self.membership.ready else "")
        return pb.PoolsReadyResponse()

    async def StartTransfer(self, request, context):
        """A worker asks before it moves the first byte of a job (see :mod:`.jobs`)."""
        await self._guard(context)
        record = await self._worker(request.worker_id, context)
        plan = self.membership.plan
        if plan is None or request.epoch != plan.epoch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"job {request.job_id} is of pool epoch {request.epoch}; pools are at "
                                f"{plan.epoch if plan else 'none'}")
        job = self.jobs.start(JobId(request.job_id), record.worker_id, time.monotonic())
        if isinstance(job, StartRefused):
            log.warning("worker %s may not start job %d: %s", record.worker_id, request.job_id, job.value)
            code = grpc.StatusCode.DEADLINE_EXCEEDED if job is StartRefused.LATE else \
                grpc.StatusCode.FAILED_PRECONDITION
            await context.abort(code, f"job {request.job_id} is {job.value}; move nothing")
        return pb.StartTransferResponse(deadline=job.deadline)

    async def CompleteTransfer(self, request, context):
        record = await self._worker(request.worker_id, context)
        state = self._report(JobId(request.job_id), record.worker_id, request.ok, request.error)
        return pb.CompleteTransferResponse(committed=state is JobState.CONFIRMED,
                                           accepted=state in (JobState.CONFIRMED, JobState.PENDING))

    def _report(self, job_id: JobId, worker_id: WorkerId, ok: bool, error: str) -> JobState | None:
        """One worker's word on a job; settles the job once it is decided and fully reported."""
        job = self.jobs.report(job_id, worker_id, ok, error)
        if job is None:
            return None  # late: already settled (expired, released or pools replanned)
        if not ok:
            log.warning("worker %s failed job %d: %s", worker_id, job_id, error)
        state = job.state
        if state is JobState.CONFIRMED:
            self._settle(job, True)
        elif state is JobState.FAILED and job.all_reported:
            self._settle(job, False, job.error)
        return state

    # ------------------------------------------------------------------ status
    async def Status(self, request, context):
        reg = self.tiers.registry
        tiers = []
        host_rate, disk_rate = self.metrics.hits.rates()
        for tier, pool in reg.pools.items():
            tiers.append(pb.TierStatus(tier=int(tier), capacity_blocks=pool.capacity,
                                       used_blocks=pool.allocator.num_used,
                                       pinned_blocks=reg.count_pinned(tier),
                                       hit_rate=host_rate if tier is Tier.HOST else disk_rate))
        state = ("shutting-down" if self.closing else "ready" if self.membership.ready
                 else "waiting-for-workers" if not self.membership.all_attached else "starting")
        return pb.StatusResponse(leader_id=self.leader_id, state=state, tiers=tiers,
                                 workers=self._worker_infos(), sessions=len(self.sessions),
                                 pending_jobs=len(self.jobs), counters=dict(self.metrics.values))

    # ------------------------------------------------------------------ background
    def _spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def tick(self, now: float) -> None:
        """Expire sessions and jobs; called periodically by the daemon."""
        for session in self.sessions.pop_expired(now):
            log.warning("session %s (%s) expired: releasing its pins and jobs",
                        session.session_id[:8], session.client_name)
            self._end_session_jobs(session.session_id, "session expired")
        for job in self.jobs.due(now):
            self._settle(job, False, job.error or "deadline passed")
        self._maybe_demote()

    def _maybe_demote(self) -> None:
        self._announce()
        pool = self.tiers.registry.pools.get(Tier.HOST)
        if pool is None or self._demotion_in_flight or not self.membership.ready:
            return
        target = int(pool.capacity * self.config.host_free_watermark)
        if pool.allocator.num_free >= target:
            return
        plan = self.tiers.prepare_demotion(self.jobs.next_id(), target)
        self._announce()
        self.metrics.inc("kvbm_evicted_blocks", plan.dropped)
        if plan.demotions:
            job, signed = self._new_job(plan, None)
            log.debug("demotion decision job=%d: G2->G3 %d blocks, dropped %d", job.job_id,
                      len(plan.demotions), plan.dropped)
            self._demotion_in_flight = True
            self._spawn(self._send_command(job, signed, "_demotion_in_flight"))

    async def _send_command(self, job: Job, signed: pb.SignedPlan, in_flight_flag: str) -> None:
        try:
            await asyncio.gather(*(self._command(w, job, signed) for w in job.expected))
        finally:
            setattr(self, in_flight_flag, False)

    async def _command(self, worker_id: WorkerId, job: Job, signed: pb.SignedPlan) -> None:
        record = self.membership.workers.get(worker_id)
        if record is None:
            return
        ack = await self.commands.send(record, pb.CommandRequest(plan=signed), self.config.job_timeout_secs)
        if ack.response is not None and not ack_is_authentic(self.node_key, ack.response, worker_id, job.job_id):
            # Not the worker's word (forged, or for another job): the copy may still run, so the
            # job expires instead (its slots stay reserved until then).
            self.metrics.inc("kvbm_commands_undelivered")
            log.error("command job=%d: acknowledgement over %s not signed by worker %s; ignored", job.job_id,
                      self.commands.name, worker_id)
            return
        if ack.delivered:
            self._report(job.job_id, worker_id, ack.ok, ack.error)
        else:  # the worker may still be copying: the job expires (and frees its slots) later
            self.metrics.inc("kvbm_commands_undelivered")
            log.warning("command job=%d to worker %s over %s not acknowledged: %s", job.job_id, worker_id,
                        self.commands.name, ack.error)

    async def wait_attached(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._attached.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        """Stop taking requests, tell workers, close channels (idempotent)."""
        self.closing = True
        for queue in list(self._events.values()):
            queue.put_nowait(pb.LeaderEvent(shutdown=pb.Shutdown(reason="leader shutting down")))
            queue.put_nowait(None)
        for task in list(self._background):
            task.cancel()
        await self.commands.close()
        await self.events.close()
        self.metrics.close()
