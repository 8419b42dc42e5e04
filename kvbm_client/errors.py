"""The kvbm exception hierarchy.

Every error derives from :class:`KvbmError`; leaf classes also subclass the matching
built-in (``TimeoutError``, ``ConnectionError``, ``ValueError``) so callers may catch either.
Data-path faults in connectors degrade to a cache miss; these exceptions are for callers
of :class:`kvbm_client.client.KvbmClient` that want to know why.
"""
from __future__ import annotations

import grpc


class KvbmError(Exception):
    """Base class of every kvbm error."""


class KvbmConfigError(KvbmError, ValueError):
    """The configuration (DYN_KVBM_* environment or flags) is invalid."""


class KvbmUnavailableError(KvbmError, ConnectionError):
    """The leader or a worker cannot be reached (not started, died, or shutting down)."""


class KvbmTimeoutError(KvbmError, TimeoutError):
    """An operation did not complete within its deadline."""


class KvbmRequestError(KvbmError, ValueError):
    """The service rejected a request as invalid (bad ids, sizes, unknown region...)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class KvbmTransferError(KvbmError):
    """A transfer was accepted but failed on the worker (I/O error, rolled back)."""


def from_rpc_error(err: grpc.RpcError, what: str) -> KvbmError:
    """Map a gRPC error to the matching :class:`KvbmError` leaf."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    msg = f"{what}: {details}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return KvbmUnavailableError(msg)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KvbmTimeoutError(msg)
    if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INTERNAL):
        return KvbmTransferError(msg)
    return KvbmRequestError(msg, code)
