"""The synchronous leader session (the vLLM scheduler role's link) against a real leader."""
from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from kvbm_client import KvbmRequestError, KvbmUnavailableError, sequence_hashes
from kvbm_client.leader_session import LeaderSession


def hashes(n: int, seed: int = 0):
    return sequence_hashes([seed * 7919 + i for i in range(n * 16)], 16)


def test_store_then_load_round_trip_through_a_session(make_node):
    node = make_node()
    client, engines = node.ready_client()  # registers the engine buffer, runs the copies
    keys = hashes(6)
    with LeaderSession(node.leader_address, timeout=5) as session:
        store = session.prepare_store(keys)
        assert store.num_blocks == 6 and store.indices == tuple(range(6))
        client.start(store, [0, 1, 2, 3, 4, 5])
        client.wait(store)
        again = session.prepare_store(keys)
        assert again.is_empty and again.skipped_present == 6

        load = session.prepare_load(keys + hashes(2, seed=9), count_hit=True, tokens_per_block=16)
        assert load.num_blocks == 6, "the stored prefix, not the unknown tail"
        client.start(load, [10, 11, 12, 13, 14, 15])
        client.wait(load)
    array = engines["0"].array
    assert np.array_equal(array[10:16], array[0:6])
    assert client.match(keys).num_matched == 6


def test_release_unpins_and_close_is_idempotent(make_node):
    node = make_node()
    client, _ = node.ready_client()
    keys = hashes(3)
    client.wait(client.offload(keys, [0, 1, 2]))
    session = LeaderSession(node.leader_address, timeout=5)
    load = session.prepare_load(keys)
    assert load.num_blocks == 3
    session.release(load)
    with pytest.raises(KvbmRequestError, match="no pending job"):  # gone at the leader: unpinned
        session.release(load)
    session.close()
    session.close()


def test_unreachable_leader_fails_fast_with_a_clear_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(KvbmUnavailableError, match="open session"):
        LeaderSession(f"unix:{tmp_path}/no-leader.sock", timeout=0.5)
    assert time.monotonic() - start < 3


def test_session_is_reopened_after_a_leader_restart(make_node):
    node = make_node()
    client, _ = node.ready_client()
    session = LeaderSession(node.leader_address, timeout=5)
    first = session.session_id
    node.leader.send_signal(signal.SIGKILL)
    node.leader.wait(10)
    node.start_leader()
    node.wait_attached()
    # The new leader knows neither the session nor the blocks: an empty answer, no error.
    end = time.monotonic() + 10
    while True:
        try:
            handle = session.prepare_load(hashes(2))
            break
        except KvbmUnavailableError:  # the socket is not back yet
            if time.monotonic() > end:
                raise
            time.sleep(0.1)
    assert handle.is_empty
    assert session.session_id != first
    session.close()
