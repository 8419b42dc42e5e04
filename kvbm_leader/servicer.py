"""The leader's gRPC servicer: a thin adapter. Each handler validates the request's shape,
calls the one unit that decides it, and maps the unit's answer (or its :class:`~.refusals.Refused`)
to a response (or a status). No decision is taken here.

Who decides each Leader RPC (the access policy of :mod:`kvbm_client.security` runs first:
the worker RPCs need the node's daemon token):

=================  ==================  =====================================================
RPC                module              what it decides
=================  ==================  =====================================================
OpenSession        ``sessions.py``     admit a client: session limits, TTL clamp, name length
KeepAlive          ``sessions.py``     renew the lease
CloseSession       ``sessions.py``     end the lease; its pending jobs are released (``ledger.py``)
Match              ``planner.py``      longest ready prefix (policy: ``placement.py``)
PrepareStore       ``planner.py``      size limit, slots to write, evictions (``placement.py``)
PrepareLoad        ``planner.py``      prefix to pin and load (``placement.py``); its stage's
                                       workers ``fleet.py``
Release            ``ledger.py``       roll back now, or keep reserved until started copies end
Attach             ``fleet.py``        admit an expected worker, its event stream (``streams.py``)
SetLayout          ``fleet.py``        validate the layout, (re)plan the pools (``membership.py``)
PoolsReady         ``fleet.py``        a worker allocated this epoch's pools
StartTransfer      ``ledger.py``       may this worker start this job now (``jobs.py``)
CompleteTransfer   ``ledger.py``       one worker's report: commit, roll back, bad copies
Status             ``status.py``       what the node shows
=================  ==================  =====================================================

Leader-initiated moves (demotions, promotions, over gRPC ``Worker.Command`` or NATS) are
decided by ``rebalancer.py``; expiry of sessions and jobs by the tick (``service.py``).
Runs in the leader daemon, on its event loop.
"""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, NoReturn, Sequence, cast

import grpc

from kvbm_client.contract import pb
from kvbm_client.ids import MAX_HASH_BYTES, BlockHash, JobId, SessionId, SlotId, Tier, WorkerId

from .jobs import JobState
from .ledger import wire_tiers
from .membership import Layout, WorkerRecord
from .refusals import Refused, Why
from .service import LeaderService

_CODES = {
    Why.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Why.UNKNOWN: grpc.StatusCode.NOT_FOUND,
    Why.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    Why.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Why.NOT_LIVE: grpc.StatusCode.FAILED_PRECONDITION,
    Why.LATE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Why.CLOSING: grpc.StatusCode.UNAVAILABLE,
}
Context = Any  # grpc.aio.ServicerContext


async def _abort(context: Context, refusal: Refused) -> NoReturn:
    await context.abort(_CODES[refusal.why], refusal.message)
    raise AssertionError("context.abort returned")  # pragma: no cover


class LeaderServicer:
    """Implements ``kvbm.v1.Leader`` over a :class:`~.service.LeaderService`."""

    def __init__(self, service: LeaderService) -> None:
        self.service = service

    # ------------------------------------------------------------------ validation
    def _open(self) -> None:
        if self.service.closing:
            raise Refused(Why.CLOSING, "leader is shutting down")

    def _session(self, session_id: str) -> SessionId:
        self._open()
        return self.service.sessions.require(SessionId(session_id), time.monotonic())

    def _hashes(self, hashes: Sequence[bytes], what: str = "hashes") -> list[BlockHash]:
        limit = self.service.config.max_hashes
        if len(hashes) > limit:
            raise Refused(Why.INVALID, f"{len(hashes)} {what} in one request; at most {limit}")
        keys = cast("list[BlockHash]", list(hashes))  # protobuf hands out bytes objects already
        sizes = set(map(len, keys))  # one pass (every lookup's 1258 keys at 20K tokens)
        if sizes and not (0 < min(sizes) and max(sizes) <= MAX_HASH_BYTES):
            i, h = next((i, h) for i, h in enumerate(keys) if not 0 < len(h) <= MAX_HASH_BYTES)
            raise Refused(Why.INVALID, f"{what}[{i}] has {len(h)} bytes; 1..{MAX_HASH_BYTES} allowed")
        return keys

    # ------------------------------------------------------------------ clients
    async def OpenSession(self, request: "pb.OpenSessionRequest", context: Context) -> "pb.OpenSessionResponse":
        try:
            self._open()
            return self.service.open_session(request.client_name, request.ttl_ms)
        except Refused as refusal:
            await _abort(context, refusal)

    async def KeepAlive(self, request: "pb.KeepAliveRequest", context: Context) -> "pb.KeepAliveResponse":
        try:
            self._session(request.session_id)
        except Refused as refusal:
            await _abort(context, refusal)
        return pb.KeepAliveResponse(ready=self.service.membership.ready)

    async def CloseSession(self, request: "pb.CloseSessionRequest", context: Context) -> "pb.CloseSessionResponse":
        await self.service.close_session(SessionId(request.session_id))
        return pb.CloseSessionResponse()

    async def Match(self, request: "pb.MatchRequest", context: Context) -> "pb.MatchResponse":
        try:
            self._session(request.session_id)
            keys = self._hashes(request.hashes)
        except Refused as refusal:
            await _abort(context, refusal)
        result = await self.service.planner.match(keys, request.count_hit, request.tokens_per_block)
        return pb.MatchResponse(num_matched=result.num_matched, tiers=wire_tiers(result.tiers))

    async def PrepareStore(self, request: "pb.PrepareStoreRequest", context: Context) -> "pb.PrepareStoreResponse":
        try:
            session = self._session(request.session_id)
            keys = self._hashes(request.hashes)
            parents: list[BlockHash | None] | None = None
            if request.parent_hashes:
                parents = list(self._hashes(request.parent_hashes, "parent_hashes"))
                if len(parents) != len(keys):
                    raise Refused(Why.INVALID, f"{len(parents)} parent_hashes for {len(keys)} hashes")
            self.service.planner.count_unasked(request.unasked_blocks)
            plan, signed = await self.service.planner.prepare_store(session, keys, parents)
        except Refused as refusal:
            await _abort(context, refusal)
        resp = pb.PrepareStoreResponse(skipped_present=plan.skipped_present, skipped_full=plan.skipped_full)
        if signed is not None:
            resp.plan.CopyFrom(signed)
            resp.indices.extend(plan.indices)
        return resp

    async def PrepareLoad(self, request: "pb.PrepareLoadRequest", context: Context) -> "pb.PrepareLoadResponse":
        try:
            session = self._session(request.session_id)
            keys = self._hashes(request.hashes)
            stage = None
            if request.HasField("stage"):  # sent as soon as the plan is signed: its copy starts meanwhile
                stage = self.service.fleet.stage_sender(request.stage)
            self.service.planner.count_unasked(request.unasked_blocks)
            plan, signed = await self.service.planner.prepare_load(session, keys, request.count_hit,
                                                                   request.tokens_per_block,
                                                                   request.prefill_tokens_per_s, stage)
        except Refused as refusal:
            await _abort(context, refusal)
        resp = pb.PrepareLoadResponse(num_planned=len(plan.keys), num_skipped=plan.skipped_cost)
        if signed is not None:
            resp.plan.CopyFrom(signed)
        return resp

    async def Release(self, request: "pb.ReleaseRequest", context: Context) -> "pb.ReleaseResponse":
        try:
            session = self._session(request.session_id)
            await self.service.release(session, JobId(request.job_id))
        except Refused as refusal:
            await _abort(context, refusal)
        return pb.ReleaseResponse()

    # ------------------------------------------------------------------ workers
    async def Attach(self, request: "pb.AttachRequest", context: Context) -> AsyncIterator["pb.LeaderEvent"]:
        record = WorkerRecord(WorkerId(request.worker_id), request.rank, request.endpoint, request.pid, request.cuda)
        try:
            self._open()
            self.service.fleet.attach(record)
        except Refused as refusal:
            await _abort(context, refusal)
        async for event in self.service.fleet.serve(record):
            yield event

    async def SetLayout(self, request: "pb.SetLayoutRequest", context: Context) -> "pb.SetLayoutResponse":
        lay = request.layout
        try:
            self._open()
            record = self.service.fleet.record(request.worker_id)
            layout = Layout(lay.num_layers, lay.page_bytes, lay.dtype, lay.num_engine_blocks, record.rank)
            self.service.fleet.set_layout(request.worker_id, layout)
        except Refused as refusal:
            await _abort(context, refusal)
        return pb.SetLayoutResponse()

    async def PoolsReady(self, request: "pb.PoolsReadyRequest", context: Context) -> "pb.PoolsReadyResponse":
        try:
            self.service.fleet.pools_ready(request.worker_id, request.epoch, request.ok, request.error,
                                           request.disk_index)
        except Refused as refusal:
            await _abort(context, refusal)
        return pb.PoolsReadyResponse()

    async def StartTransfer(self, request: "pb.StartTransferRequest", context: Context) -> "pb.StartTransferResponse":
        try:
            self._open()
            record = self.service.fleet.record(request.worker_id)
            job = self.service.ledger.start(JobId(request.job_id), record.worker_id, request.epoch, time.monotonic())
        except Refused as refusal:
            await _abort(context, refusal)
        return pb.StartTransferResponse(deadline=job.deadline)

    async def CompleteTransfer(self, request: "pb.CompleteTransferRequest",
                               context: Context) -> "pb.CompleteTransferResponse":
        try:
            record = self.service.fleet.record(request.worker_id)
        except Refused as refusal:
            await _abort(context, refusal)
        bad = [(Tier.DISK, SlotId(s)) for s in request.bad_disk_slots] + \
              [(Tier.HOST, SlotId(s)) for s in request.bad_host_slots]
        state = await self.service.ledger.report(JobId(request.job_id), record.worker_id, request.ok,
                                                 request.error, bad, (request.bytes, request.seconds))
        return pb.CompleteTransferResponse(committed=state is JobState.CONFIRMED,
                                           accepted=state in (JobState.CONFIRMED, JobState.PENDING))

    # ------------------------------------------------------------------ status
    async def Status(self, request: "pb.StatusRequest", context: Context) -> "pb.StatusResponse":
        return self.service.status()
