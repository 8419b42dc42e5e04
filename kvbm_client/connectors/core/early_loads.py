"""Early loads: the scheduler side starts a hit's copy as soon as the engine allocated its blocks
(and, with ``staged_loads``, names the worker daemons and the engine's regions on them, for the
leader to stage a hit on at its lookup).

Without it the copy starts in the worker side's ``start_load_kv``, after the scheduler
finished the step and the model runner prepared its inputs (~15 ms on a 20K-token request,
vLLM 0.26 on an H100). Here the scheduler side sends the same signed plan to the worker
daemon(s) once the engine allocated the blocks, at the end of the step's scheduling (vLLM's
``build_connector_meta``: only then is it known whether the step fences, see
:mod:`.scheduler`); the
daemon runs a job once per plan, so the worker side's own ``Transfer`` joins the copy already
running and returns when it is done. The worker side's call stays the one whose answer
counts: an early call that fails only costs the head start (it is logged at debug level and
never waited for). With ``staged_loads`` the lookup asks the leader to stage the hit on the
workers :meth:`EarlyLoads.stage_targets` names (``PrepareLoadRequest.stage``): the leader sends
each the plan before it answers, the worker copies the hit's first layer group into its own
staging area meanwhile, and the early load (or the worker side's call) takes them from there.

Runs on the engine's scheduler thread: one non-blocking gRPC call per worker per load, plus
one small file read to learn the engine's region on a worker when it is not known yet (at
most once per ``retry_s`` until the worker side registered it). A region id is a capability
no daemon shows; the worker side publishes its own for this side (:mod:`.region_ids`).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import grpc

from ...channels import open_channel
from ...contract import pb, rpc
from ...ids import WorkerId
from .region_ids import EngineRegionIds
from .specs import LoadSpec
from .settings import Backoff, ConnectorSettings

log = logging.getLogger("kvbm.connector")

FORGET_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)


def early_loads_decision(wanted: bool, has_workers: bool, overlapping_steps: int,
                         defers_block_frees: bool) -> tuple[bool, str]:
    """Whether an engine's scheduler side starts loads early, and why (pure). With overlapping
    steps only where the engine keeps freed blocks out of its pool until the steps in flight
    that may write them have run: else the next step may be given a block a step in flight
    still writes, and only the worker side orders a load after it (issue 17 window 4)."""
    if not wanted:
        return False, "early_loads is false"
    if not has_workers:
        return False, "no worker daemon is known to this role"
    if overlapping_steps <= 1:
        return True, "one engine step at a time"
    if defers_block_frees:
        return True, (f"{overlapping_steps} steps in flight; the engine defers block frees past them, and no "
                      "load starts early while a step in flight fenced")
    return False, (f"{overlapping_steps} steps in flight and the engine reuses freed blocks at once: only the "
                   "worker role may start a load")


class _WorkerLink:
    """One worker daemon, as the scheduler side sees it: its engine region id and the early
    calls not yet finished."""

    def __init__(self, worker_id: str, settings: ConnectorSettings, ids: EngineRegionIds) -> None:
        self.worker_id = WorkerId(worker_id)
        self.address = address = settings.worker_address(worker_id)
        self.ids = ids
        self.timeout_s = settings.timeout_s
        self.channel = open_channel(address, settings.config)
        self.stub: Any = rpc.WorkerStub(self.channel)  # the generated stubs are untyped
        self.region_id: str | None = None
        self.backoff = Backoff(settings.retry_s)
        self.pending: "list[grpc.Future[Any]]" = []
        self._area: bool | None = None  # whether the worker has a staging area (None: not known yet)
        self._status: "grpc.Future[Any] | None" = None  # the Status call that tells it
        self._status_backoff = Backoff(settings.retry_s)

    def submit(self, spec: LoadSpec) -> bool:
        return self._send(spec.plan, spec.signature, spec.layer_groups, spec.engine_blocks)

    def _send(self, plan: bytes, signature: bytes, layer_groups: int, engine_blocks: Sequence[int]) -> bool:
        self._reap()
        region_id = self.region()
        if region_id is None:
            return False
        request = pb.TransferRequest(region_id=region_id, plan=pb.SignedPlan(plan=plan, signature=signature),
                                     engine_blocks=engine_blocks, sent_at=time.time(), layer_groups=layer_groups)
        self.pending.append(self.stub.Transfer.future(request, timeout=max(self.timeout_s, 30.0)))
        return True

    def region(self) -> str | None:
        """The engine's region id on this worker (None: not registered yet, asked again after ``retry_s``)."""
        if self.region_id is not None or not self.backoff.ready():
            return self.region_id
        self.region_id = self.ids.lookup(self.worker_id)
        if self.region_id is None:  # the worker side has not registered the engine's memory yet
            log.debug("kvbm early loads: no region of this engine on worker %s yet", self.worker_id)
            self.backoff.failed()
        return self.region_id

    def has_area(self) -> bool:
        """Whether the worker has a staging area (``kvbm-worker --stage-mib``), from its Status
        once its pools are ready. Never blocks: asked in the background at the first call (and
        again after ``retry_s`` while the worker is not ready or did not answer); False meanwhile."""
        if self._area is not None:
            return self._area
        if self._status is not None and self._status.done():
            self._read_area(self._status)
        if self._area is None and self._status is None and self._status_backoff.ready():
            self._status = self.stub.Status.future(pb.WorkerStatusRequest(), timeout=self.timeout_s)
        return bool(self._area)

    def _read_area(self, status: "grpc.Future[Any]") -> None:
        """Take the area from a finished Status call (one that did not tell: asked again later)."""
        self._status = None
        try:
            info = status.result().info
        except grpc.RpcError as exc:
            log.debug("kvbm early loads: no status from %s (%s)", self.address, exc.code().name)
            self._status_backoff.failed()
            return
        if info.state != "ready":
            self._status_backoff.failed()
            return
        self._area = info.stage_bytes > 0
        log.debug("kvbm: worker %s %s", self.worker_id, f"stages loads (a {info.stage_bytes / (1 << 20):.1f} MiB area)"
                  if self._area else "has no staging area (kvbm-worker --stage-mib 0): its loads are not staged")

    def _reap(self) -> None:
        still = []
        for future in self.pending:
            if not future.done():
                still.append(future)
                continue
            exc = future.exception()
            if isinstance(exc, grpc.RpcError):
                log.debug("kvbm early load on %s: %s (the worker role's call decides)", self.address,
                          exc.details() or exc.code().name)
                if exc.code() in FORGET_CODES:  # re-registered or restarted: ask for the region (and area) again
                    self.region_id = self._area = None
        self.pending = still

    def close(self) -> None:
        for future in self.pending + ([self._status] if self._status is not None else []):
            future.cancel()
        self.pending = []
        self.channel.close()


class EarlyLoads:
    """Starts loads on every worker daemon of the engine (one per tensor-parallel rank)."""

    def __init__(self, settings: ConnectorSettings, worker_ids: Sequence[str]) -> None:
        ids = EngineRegionIds(settings.config.resolved_socket_dir, settings.engine_id)
        self._links = [_WorkerLink(w, settings, ids) for w in worker_ids]

    def submit(self, spec: LoadSpec) -> int:
        """Send ``spec`` to each worker; returns how many calls went out."""
        return sum(link.submit(spec) for link in self._links)

    def stage_targets(self) -> tuple[tuple[WorkerId, str], ...]:
        """The workers a lookup's stage goes to, each with the engine's region there: those
        whose region is known and that have a staging area. The leader sends them the plan
        (``PrepareLoadRequest.stage``)."""
        return tuple((link.worker_id, region) for link in self._links
                     if link.has_area() and (region := link.region()) is not None)

    def close(self) -> None:
        for link in self._links:
            link.close()
