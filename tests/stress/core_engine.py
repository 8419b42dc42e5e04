"""A stand-in engine for the daemon-level window tests: the connector's real engine-independent
core (:class:`SchedulerCore`, :class:`WorkerCore`) over a shared-memory KV buffer, driven the
way an engine drives it, against a real leader and worker.

Runs in the test process. The engine's part is only what decides the windows: which blocks
a request holds, when the engine takes them back (a finished request whose frees are not
delayed, a preempted request once the fence returned, a delayed free once the worker side
reports it), and that another request then writes its own KV there (:meth:`CoreEngine.reuse`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from kvbm_client import KvbmClient, KvbmConfig, ShmKvBuffer
from kvbm_client.connectors.core import (ConnectorSettings, EarlyLoads, LeaderLink, RequestExtras, SchedulerCore,
                                         StepPlan, WorkerCore)
from kvbm_client.connectors.core.store_planner import StorePlanner
from kvbm_client.hashing import BlockIdentity
from kvbm_client.ids import WorkerId

from .node import StressNode

BS = 16  # tokens per block (any size works for the core)
NAMESPACE = "windows"


@dataclass
class Req:
    """An engine's request as the core reads it."""

    request_id: str
    all_token_ids: list[int]


def tokens(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(10, 1000, n)]


def keys_of(token_ids: Sequence[int]) -> list[bytes]:
    """kvbm's keys of the full blocks of ``token_ids`` (what the scheduler core stores them under)."""
    return list(BlockIdentity(NAMESPACE, BS, RequestExtras()).update(list(token_ids)))


class CoreEngine:
    """The cores of one engine (one worker) on ``buffer``; ``early``: the scheduler side starts
    loads early (as the vLLM adapter does without asynchronous scheduling); ``planned_stores``:
    a step's stores are planned off the scheduler's thread and ship with the next step, sent
    before its forward (the vLLM adapter's default, ``async_store_plans``)."""

    def __init__(self, node: StressNode, buffer: ShmKvBuffer, early: bool = False, planned_stores: bool = False,
                 **extra: object) -> None:
        self.node, self.buffer = node, buffer
        self.settings = ConnectorSettings.from_extra(
            {"socket_dir": node.env["DYN_KVBM_SOCKET_DIR"], "retry_s": 0.5, "early_loads": early, **extra},
            NAMESPACE)
        planner = StorePlanner(LeaderLink(self.settings, "windows-stores")) if planned_stores else None
        self.planned_stores = planned_stores
        self.sched = SchedulerCore(BS, self.settings, LeaderLink(self.settings, "windows"),
                                   lambda request: RequestExtras(), EarlyLoads(self.settings, ["0"]) if early else None,
                                   store_planner=planner)
        self.worker = WorkerCore(WorkerId("0"), self.settings)
        self.worker.set_region(buffer.spec())

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()

    # ------------------------------------------------------------------ one request at a time
    def schedule(self, req: Req, blocks: Sequence[int], local_tokens: int = 0) -> int:
        """The engine admits ``req`` into engine ``blocks`` with ``local_tokens`` of its own
        prefix; returns the tokens kvbm loads (planned into the blocks)."""
        external, _ = self.sched.lookup(req, local_tokens)
        self.sched.allocated(req.request_id, list(blocks), external)
        self.sched.assign_blocks(req.request_id, blocks, replace=True)
        return external

    def step(self, computed: dict[str, int], preempted: Iterable[str] = ()) -> StepPlan:
        """One engine step: the plan, then the worker side's hooks in the engine's order
        (earlier steps' stores and the fence when the plan is bound, loads, this step's stores
        once the forward ran); returns the plan."""
        plan = self.sched.step(computed, list(preempted))
        self.worker.start_stores(plan.earlier_stores)
        if plan.fence:
            self.worker.fence()
        self.worker.start_loads(plan.loads)
        self.worker.start_stores(plan.stores)
        return plan

    def store(self, req: Req, blocks: Sequence[int]) -> None:
        """Compute ``req`` in ``blocks`` and store its full blocks (waited for, then checked:
        a test that builds on a store that silently stored less would fail later, far from why)."""
        self.schedule(req, blocks)
        self.step({req.request_id: len(req.all_token_ids)})
        if self.planned_stores:
            self.step({})  # the next step ships them
        self.worker.fence()
        full = len(req.all_token_ids) // BS
        if (served := self.matched(req.all_token_ids)) != full:
            raise AssertionError(f"{req.request_id}'s store left {served} of its {full} full blocks served")

    def release(self, req_id: str, timeout: float = 120.0) -> float:
        """The request ended: wait until the engine may reuse its blocks (at once, or once
        the worker side reports its delayed free); returns the seconds waited."""
        t0 = time.monotonic()
        if not self.sched.finished(req_id):
            return 0.0
        pending: list[str] = []
        end = t0 + timeout
        while time.monotonic() < end:
            plan = self.sched.step({})
            pending += plan.delayed_frees
            sent, _ = self.worker.finished(plan.delayed_frees)
            if req_id in sent:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise AssertionError(f"the worker side never released {req_id}'s blocks")

    def reuse(self, blocks: Sequence[int], value: int) -> None:
        """Another request writes its KV into ``blocks`` (the engine gave them to it)."""
        self.buffer.array[list(blocks)] = value

    def matched(self, token_ids: Sequence[int]) -> int:
        """How many leading blocks of ``token_ids`` kvbm would serve now."""
        with KvbmClient(KvbmConfig.from_env(self.node.env), client_name="windows-probe") as client:
            return int(client.match(keys_of(token_ids), count_hit=False).num_matched)
