"""Checks of the running node, when there is one: the leader and each worker answer Status,
pools are allocated, hit rates, and the counters of things that went wrong.

Runs in ``kvbm doctor``. A node that is not running is a fact ("not running", INFO), not a
failure: doctor is meant to run before ``kvbm serve`` as well as beside it.
"""
from __future__ import annotations

import functools
from typing import Callable

import grpc

from ..contract import pb
from ..ids import Tier
from .base import Check, CheckFn, CheckResult, DoctorContext, NodeProbe, fail, info, ok, skip, warn

#: Leader counters that only grow when something went wrong.
FAILURE_COUNTERS = ("kvbm_failed_jobs", "kvbm_lost_blocks", "kvbm_commands_undelivered", "kvbm_kv_events_dropped")
#: The worker's own counter of copies that failed.
WORKER_FAILURES = "jobs_failed"
LOGS = "look at the leader's and workers' logs (DYN_LOG=debug logs every decision)"


def on_running_node(fn: Callable[[NodeProbe, "pb.StatusResponse"], CheckResult]) -> CheckFn:
    """A check of the running node: skipped when none runs, else given the probe and the
    leader's Status answer."""
    @functools.wraps(fn)
    def check(ctx: DoctorContext) -> CheckResult:
        node = ctx.node()
        return skip("node not running") if node.status is None else fn(node, node.status)
    return check


def check_leader(ctx: DoctorContext) -> CheckResult:
    """The leader answers Status; its state says whether the pools are planned and allocated."""
    node = ctx.node()
    st = node.status
    if st is None:
        if node.code is grpc.StatusCode.UNAVAILABLE and not node.listening:
            return info(f"not running (no leader answers at {node.address})", running=False)
        return fail(f"a process accepts connections at {node.address} but does not answer Status "
                    f"({node.error})", f"the leader may be hung or stopped: {LOGS}; restart it", running=False)
    text = f"leader {st.leader_id} at {node.address}: {st.state}, {len(st.workers)} worker(s), " \
           f"{st.sessions} session(s), {st.pending_jobs} job(s) in flight"
    if st.state == "ready":
        return ok(text, running=True, state=st.state)
    if st.state == "waiting-for-workers":
        return warn(text, "start the missing kvbm-worker(s); the leader waits for them up to "
                    "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS", running=True, state=st.state)
    return info(f"{text} (pools are allocated once the engine registers its KV cache)", running=True, state=st.state)


def _worker_line(leader_view: "pb.WorkerInfo", answer: "pb.WorkerStatusResponse | str") -> tuple[str, str]:
    """(state, text) of one worker: its state as the leader tracks it (waiting-for-engine,
    allocating, ready, failed), or "unreachable" when the worker itself does not answer."""
    wid = leader_view.worker_id
    if isinstance(answer, str):
        return "unreachable", f"{wid}: unreachable ({answer})"
    state = leader_view.state
    progress = f" {answer.info.alloc_progress * 100:.0f}%" if state == "allocating" else ""  # the worker knows best
    backend = f", G3 via {answer.disk_backend}" if answer.disk_backend else ""
    return state, f"{wid}: {state}{progress}{backend}"


@on_running_node
def check_workers(node: NodeProbe, st: "pb.StatusResponse") -> CheckResult:
    """Every worker the leader lists answers its own Status; their pools are allocated."""
    if not st.workers:
        return warn("no worker attached to the leader", "start kvbm-worker (kvbm serve starts them)")
    lines = [_worker_line(w, node.workers.get(w.worker_id, "not asked")) for w in st.workers]
    states = [state for state, _ in lines]
    text = "; ".join(t for _, t in lines)
    data = {"states": {w.worker_id: state for w, state in zip(st.workers, states)}}
    if "unreachable" in states:
        return fail(text, f"a worker the leader lists does not answer: {LOGS}", **data)
    if "failed" in states:
        return fail(text, "pool allocation failed: the worker's log says why (memory, disk, init timeout); "
                    "the config.* and disk.* checks name the usual causes", **data)
    if all(s == "ready" for s in states):
        return ok(text, **data)
    return info(text, "pools are allocated when the engine registers its KV cache", **data)


@on_running_node
def check_pools(_node: NodeProbe, st: "pb.StatusResponse") -> CheckResult:
    """Pools as the leader holds them: capacity, use, pins and hit rates per tier."""
    if not st.tiers:
        return info("no pools yet (the engine has not registered its KV cache)")
    parts, data = [], {}
    for t in st.tiers:
        label = Tier(t.tier).label
        parts.append(f"{label} {t.used_blocks}/{t.capacity_blocks} used, {t.pinned_blocks} pinned, "
                     f"hit rate {t.hit_rate:.2f}")
        data[label] = {"capacity": t.capacity_blocks, "used": t.used_blocks, "pinned": t.pinned_blocks,
                       "hit_rate": t.hit_rate}
    empty = [Tier(t.tier).label for t in st.tiers if t.capacity_blocks == 0]
    text = "; ".join(parts) + f"; matched tokens {st.counters.get('kvbm_matched_tokens', 0):.0f}"
    if empty and st.state == "ready":
        return fail(f"{text}: {', '.join(empty)} has no capacity", "its size is below one block: see config.pools",
                    **data)
    return ok(text, **data)


@on_running_node
def check_failures(node: NodeProbe, st: "pb.StatusResponse") -> CheckResult:
    """Counters of failures since the leader started: failed jobs, lost blocks, undelivered
    commands, dropped events, and each worker's failed copies."""
    counts = {name: st.counters.get(name, 0.0) for name in FAILURE_COUNTERS}
    for wid, answer in node.workers.items():
        if not isinstance(answer, str):
            counts[f"worker {wid} {WORKER_FAILURES}"] = answer.counters.get(WORKER_FAILURES, 0.0)
    bad = {k: v for k, v in counts.items() if v}
    if bad:
        return warn(", ".join(f"{k} {v:.0f}" for k, v in bad.items()) + " since start", LOGS, **counts)
    return ok("no failed jobs, lost blocks, undelivered commands or dropped events", **counts)


CHECKS = (
    Check("node", "leader", check_leader),
    Check("node", "workers", check_workers),
    Check("node", "pools", check_pools),
    Check("node", "failures", check_failures),
)
