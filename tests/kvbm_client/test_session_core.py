"""The leader session's decisions (``kvbm_client/session.py``), shared by the asyncio client
and the blocking one: pure, no leader needed."""
from __future__ import annotations

import grpc
import pytest

from kvbm_client.contract import pb
from kvbm_client.errors import KvbmRequestError, KvbmUnavailableError
from kvbm_client.session import SessionCore, session_lost

LOST = "unknown or expired session 's-1'; open a new one"


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_new_session_is_taken_whole():
    core = SessionCore("me")
    assert core.open_request().client_name == "me"
    core.opened(pb.OpenSessionResponse(session_id="s-1", ttl_ms=9000, max_hashes=77,
                                       workers=[pb.WorkerInfo(worker_id="0", endpoint="unix:/w0")]))
    assert (core.session_id, core.ttl_s, core.max_hashes) == ("s-1", 9.0, 77)
    assert list(core.workers) == ["0"] and core.workers["0"].endpoint == "unix:/w0"
    assert core.renew_every_s == 3.0
    assert core.keepalive_request().session_id == "s-1" and core.close_request().session_id == "s-1"


@pytest.mark.parametrize("code,details,lost", [
    (grpc.StatusCode.NOT_FOUND, LOST, True),
    (grpc.StatusCode.NOT_FOUND, "no pending job 3 in this session", False),  # another NOT_FOUND
    (grpc.StatusCode.UNAVAILABLE, LOST, False),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "", False),
])
def test_only_an_unknown_session_is_a_lost_session(code, details, lost):
    exc = FakeRpcError(code, details)
    assert session_lost(exc) is lost
    assert SessionCore.reopen_after(exc) is lost


def test_a_call_is_retried_once_with_a_new_session_and_only_when_it_names_one():
    exc = FakeRpcError(grpc.StatusCode.NOT_FOUND, LOST)
    request = pb.PrepareLoadRequest()
    assert SessionCore.retry_after(exc, 0, request)
    assert not SessionCore.retry_after(exc, 1, request), "a second failure is the caller's"
    assert not SessionCore.retry_after(exc, 0, pb.StatusRequest()), "Status has no session to renew"
    assert not SessionCore.retry_after(FakeRpcError(grpc.StatusCode.UNAVAILABLE), 0, request)


def test_requests_are_stamped_with_the_current_session():
    core = SessionCore("me", session_id="s-2")
    request = pb.ReleaseRequest(session_id="s-1", job_id=4)
    core.stamp(request)
    assert request.session_id == "s-2" and request.job_id == 4
    status = pb.StatusRequest()
    core.stamp(status)  # no session field: untouched
    assert status == pb.StatusRequest()


def test_open_errors_name_the_leader():
    late = SessionCore.open_error(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED), "unix:/l.sock", 0.5)
    assert isinstance(late, KvbmUnavailableError)
    assert "open session at unix:/l.sock: no leader answered within 0.5s" in str(late)
    refused = SessionCore.open_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many sessions"),
                                     "unix:/l.sock", 0.5)
    assert isinstance(refused, KvbmRequestError) and "too many sessions" in str(refused)


def test_misses_the_filter_answered_are_told_with_the_next_call_or_kept_when_it_fails():
    from kvbm_client.leader_session import LeaderSession
    session = LeaderSession.__new__(LeaderSession)  # (no channel: _call is replaced below)
    session._unasked = 0
    sent: list[int] = []

    def call(name, request):
        sent.append(request.unasked_blocks)
        if len(sent) == 1:
            raise KvbmUnavailableError("leader down")
        return pb.PrepareStoreResponse()

    session._call = call
    session.unasked(5)
    session.unasked(7)
    with pytest.raises(KvbmUnavailableError):
        session.prepare_store([b"k" * 16])
    session.prepare_store([b"k" * 16])
    session.prepare_store([b"k" * 16])
    assert sent == [12, 12, 0], "12 told once the call went through, not lost with the failed one"
