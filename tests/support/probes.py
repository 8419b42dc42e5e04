"""Small helpers of the tests that probe real daemons: a worker's raw stub, the status code of
a refused call, waiting for a condition."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

import grpc
import pytest

from kvbm_client.contract import rpc

T = TypeVar("T")


def worker_stub(node, worker_id: str = "0") -> rpc.WorkerStub:
    """A stub on ``node``'s worker, closed with the node (the tests' ``Node``)."""
    channel = grpc.insecure_channel(node.config().worker_address(worker_id))
    node.clients.append(channel)
    return rpc.WorkerStub(channel)


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    """The status ``call`` fails with (it must fail)."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def wait_for(predicate: Callable[[], T], what: str, timeout: float = 10.0) -> T:
    """Poll ``predicate`` until it returns something true; that value."""
    end = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value
