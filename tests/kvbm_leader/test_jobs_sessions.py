"""JobTable / Job states and SessionTable leases (the caller passes the clock)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvbm_client.ids import JobId, PlanKind, SessionId, WorkerId
from kvbm_leader.jobs import Job, JobState, JobTable
from kvbm_leader.placement import JobPlacement
from kvbm_leader.refusals import Refused, Why
from kvbm_leader.sessions import SessionLimits, SessionTable

W0, W1, W2 = WorkerId("0"), WorkerId("1"), WorkerId("2")


# --------------------------------------------------------------------------- jobs
def make_job(table: JobTable, expected=(W0, W1), session: str | None = "s1",
             deadline: float = 10.0, expires: float = 12.0) -> Job:
    job = Job(JobPlacement(table.next_id(), PlanKind.STORE), SessionId(session) if session else None,
              deadline, expires, frozenset(expected))
    table.add(job)
    return job


@dataclass(frozen=True)
class ExpectedJob:
    state: JobState
    all_reported: bool
    error: str = ""


def verify_job(job: Job, expected: ExpectedJob) -> None:
    assert (job.state, job.all_reported, job.error) == (expected.state, expected.all_reported, expected.error)


def test_job_ids_are_sequential_and_never_reused() -> None:
    table = JobTable()
    first = make_job(table)
    table.pop(first.job_id)
    second = make_job(table)
    assert (first.job_id, second.job_id) == (1, 2)
    assert table.next_id() == 3


def test_adding_a_job_id_twice_is_an_invariant_violation() -> None:
    table = JobTable()
    job = make_job(table)
    with pytest.raises(AssertionError):
        table.add(job)


# reports: (worker, ok, error) in order; expected after the last one.
@pytest.mark.parametrize("reports, expected", [
    ([], ExpectedJob(JobState.PENDING, False)),
    ([(W0, True, "")], ExpectedJob(JobState.PENDING, False)),
    ([(W0, True, ""), (W0, True, "")], ExpectedJob(JobState.PENDING, False)),
    ([(W2, True, "")], ExpectedJob(JobState.PENDING, False)),  # not an expected worker
    ([(W0, True, ""), (W1, True, "")], ExpectedJob(JobState.CONFIRMED, True)),
    ([(W1, True, ""), (W2, True, ""), (W0, True, "")], ExpectedJob(JobState.CONFIRMED, True)),
    ([(W0, False, "disk full")], ExpectedJob(JobState.FAILED, False, "disk full")),
    ([(W0, False, "")], ExpectedJob(JobState.FAILED, False, "worker 0 failed")),
    ([(W0, True, ""), (W1, False, "io")], ExpectedJob(JobState.FAILED, True, "io")),
    ([(W0, False, "first"), (W1, False, "second")], ExpectedJob(JobState.FAILED, True, "first")),
])
def test_job_state_follows_worker_reports(reports, expected: ExpectedJob) -> None:
    table = JobTable()
    job = make_job(table)
    for worker, ok, error in reports:
        assert table.report(job.job_id, worker, ok, error) is job
    verify_job(job, expected)


def test_report_of_unknown_job_is_none() -> None:
    table = JobTable()
    assert table.report(JobId(99), W0, True) is None


def test_fail_keeps_the_first_error() -> None:
    table = JobTable()
    job = make_job(table)
    assert table.fail(job.job_id, "released by client") is job
    table.fail(job.job_id, "deadline passed")
    table.report(job.job_id, W0, False, "io")
    verify_job(job, ExpectedJob(JobState.FAILED, False, "released by client"))
    assert table.fail(JobId(99), "x") is None


def test_failed_job_stays_failed_when_every_worker_then_reports_ok() -> None:
    table = JobTable()
    job = make_job(table)
    table.fail(job.job_id, "session expired")
    table.report(job.job_id, W0, True)
    table.report(job.job_id, W1, True)
    verify_job(job, ExpectedJob(JobState.FAILED, True, "session expired"))


@pytest.mark.parametrize("now, expected_ids", [(11.9, []), (12.0, [1]), (14.0, [1, 2]), (100.0, [1, 2, 3])])
def test_due_returns_jobs_past_expiry(now: float, expected_ids: list[int]) -> None:
    table = JobTable()
    for expires in (12.0, 14.0, 20.0):
        make_job(table, deadline=expires - 2, expires=expires)
    assert sorted(j.job_id for j in table.due(now)) == expected_ids
    assert len(table) == 3  # due() does not remove


def test_due_ignores_the_deadline_until_expiry() -> None:
    table = JobTable()
    make_job(table, deadline=10.0, expires=12.0)
    assert table.due(10.5) == []  # past the deadline, still inside the grace


def test_of_session_pop_get_and_clear() -> None:
    table = JobTable()
    a = make_job(table, session="a")
    b = make_job(table, session="b")
    c = make_job(table, session="a")
    d = make_job(table, session=None)

    assert [j.job_id for j in table.of_session(SessionId("a"))] == [a.job_id, c.job_id]
    assert table.get(b.job_id) is b
    assert table.pop(b.job_id) is b
    assert table.pop(b.job_id) is None and table.get(b.job_id) is None
    assert [j.job_id for j in table] == [a.job_id, c.job_id, d.job_id]

    assert {j.job_id for j in table.clear()} == {a.job_id, c.job_id, d.job_id}
    assert len(table) == 0


def test_iteration_is_safe_while_popping() -> None:
    table = JobTable()
    for _ in range(3):
        make_job(table)
    for job in table:
        table.pop(job.job_id)
    assert len(table) == 0


# --------------------------------------------------------------------------- sessions
def make_sessions(*ttls: float, now: float = 0.0) -> tuple[SessionTable, list]:
    table = SessionTable()
    return table, [table.open(f"client-{i}", ttl, now) for i, ttl in enumerate(ttls)]


def test_open_creates_distinct_sessions() -> None:
    table, (a, b) = make_sessions(10.0, 10.0, now=5.0)
    assert a.session_id != b.session_id
    assert (a.client_name, a.ttl, a.renewed_at) == ("client-0", 10.0, 5.0)
    assert table.get(a.session_id) is a
    assert len(table) == 2


@pytest.mark.parametrize("now, expired", [(9.9, False), (10.0, False), (10.01, True)])
def test_session_expires_strictly_after_ttl(now: float, expired: bool) -> None:
    _, (s,) = make_sessions(10.0)
    assert s.expired(now) is expired


def test_renew_extends_the_lease() -> None:
    table, (s,) = make_sessions(10.0)
    assert table.renew(s.session_id, now=8.0)
    assert s.renewed_at == 8.0
    assert not s.expired(15.0)
    assert table.pop_expired(15.0) == []
    assert table.pop_expired(18.5) == [s]


def test_renew_of_unknown_or_closed_session_is_false() -> None:
    table, (s,) = make_sessions(10.0)
    assert table.renew(SessionId("nope"), 1.0) is False
    assert table.close(s.session_id) is s
    assert table.close(s.session_id) is None
    assert table.renew(s.session_id, 1.0) is False


def test_pop_expired_removes_only_expired_sessions() -> None:
    table, (short, long_) = make_sessions(1.0, 100.0)

    gone = table.pop_expired(50.0)

    assert gone == [short]
    assert table.get(short.session_id) is None
    assert table.get(long_.session_id) is long_
    assert table.pop_expired(50.0) == []
    assert table.renew(short.session_id, 50.0) is False  # expired sessions cannot be revived


# --------------------------------------------------------------------------- session limits
def test_admit_clamps_the_ttl_and_applies_the_default() -> None:
    table = SessionTable(SessionLimits(default_ttl=10.0, max_ttl=120.0))
    assert table.admit("a", 0, 0.0).ttl == 10.0
    assert table.admit("b", 4_000_000_000, 0.0).ttl == 120.0  # 46 days asked
    assert table.admit("c", 5_000, 0.0).ttl == 5.0
    assert table.admit("", 0, 0.0).client_name == "anonymous"


def test_admit_refuses_beyond_max_sessions_and_changes_nothing() -> None:
    table = SessionTable(SessionLimits(max_sessions=2))
    first = table.admit("a", 0, 0.0)
    table.admit("b", 0, 0.0)
    with pytest.raises(Refused) as info:
        table.admit("c", 0, 0.0)
    assert info.value.why is Why.EXHAUSTED and "at most 2" in info.value.message
    assert len(table) == 2
    table.close(first.session_id)
    assert table.admit("c", 0, 0.0).client_name == "c"


def test_admit_refuses_a_long_client_name() -> None:
    table = SessionTable(SessionLimits(max_name_bytes=8))
    with pytest.raises(Refused) as info:
        table.admit("é" * 5, 0, 0.0)  # 10 bytes in UTF-8
    assert info.value.why is Why.INVALID and len(table) == 0


def test_require_renews_or_refuses() -> None:
    table = SessionTable()
    s = table.admit("a", 0, 0.0)
    assert table.require(s.session_id, 3.0) == s.session_id and s.renewed_at == 3.0
    with pytest.raises(Refused) as info:
        table.require(SessionId("nope"), 3.0)
    assert info.value.why is Why.UNKNOWN and "unknown or expired session" in info.value.message
