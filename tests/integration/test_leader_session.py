"""The synchronous leader session (the vLLM scheduler role's link) against a real leader."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kvbm_client import KvbmRequestError, KvbmUnavailableError, sequence_hashes
from kvbm_client.contract import pb
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


def _kill_leader_then_load(node, session: LeaderSession, keys):
    """SIGKILL the leader, start a new one, then ``prepare_load(keys)`` through ``session`` once
    the new leader's socket answers."""
    node.leader.send_signal(signal.SIGKILL)
    node.leader.wait(10)
    node.start_leader()
    node.wait_attached()
    end = time.monotonic() + 10
    while True:
        try:
            return session.prepare_load(keys)
        except KvbmUnavailableError:  # the socket is not back yet
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def test_session_is_reopened_after_a_leader_restart(make_node):
    node = make_node()
    client, _ = node.ready_client()
    session = LeaderSession(node.leader_address, timeout=5)
    first = session.session_id
    # The new leader knows neither the session nor the blocks: an empty answer, no error.
    handle = _kill_leader_then_load(node, session, hashes(2))
    assert handle.is_empty
    assert session.session_id != first
    session.close()


def _host_hit_rate(node) -> float:
    """G2's hit rate in the leader's status: blocks found in G2 over blocks looked up."""
    (g2,) = [t for t in node.status().tiers if t.tier == pb.TIER_HOST]
    return g2.hit_rate


def test_the_presence_filter_rules_out_what_the_leader_does_not_hold_and_never_what_it_does(make_node):
    node = make_node()
    client, _ = node.ready_client()
    keys, others = hashes(6), hashes(200, seed=5)
    with LeaderSession(node.leader_address, timeout=5) as session:
        path = Path(session._session.presence_path)
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700, \
            "only the leader's user maps it"
        assert not any(session.may_hold(k) for k in keys), "nothing stored: every first block ruled out"
        store = session.prepare_store(keys)
        assert all(session.may_hold(k) for k in keys), "planned blocks are in the filter before they can match"
        client.start(store, [0, 1, 2, 3, 4, 5])
        client.wait(store)
        assert all(session.may_hold(k) for k in keys)
        assert sum(session.may_hold(k) for k in others) == 0, "200 unknown blocks, 12 of 2^24 slots set"
        # the leader counts the lookups the client answered itself: 6 asked and matched, then 6
        # answered by the filter, told with the next call
        session.prepare_load(keys, count_hit=True, tokens_per_block=16)
        assert abs(_host_hit_rate(node) - 1.0) < 1e-9
        session.unasked(6)
        session.release(session.prepare_load(keys, count_hit=True, tokens_per_block=16))
        assert abs(_host_hit_rate(node) - 12 / 18) < 1e-9
        assert node.status().counters["kvbm_presence_filter_misses"] == 6
    node.stop()
    assert not path.exists(), "the leader removes its filter when it stops"


def test_a_restarted_leader_publishes_a_new_filter_and_the_session_follows_it(make_node):
    node = make_node()
    client, _ = node.ready_client()
    keys = hashes(4)
    client.wait(client.offload(keys, [0, 1, 2, 3]))
    session = LeaderSession(node.leader_address, timeout=5)
    assert all(session.may_hold(k) for k in keys)
    old = Path(session._session.presence_path)
    old_view = session._presence
    assert old_view is not None and not old_view.may_hold(hashes(1, seed=5)[0])
    # no clean stop (the file stays behind); the load re-opens the session with the new leader
    assert _kill_leader_then_load(node, session, keys).is_empty
    new = Path(session._session.presence_path)
    assert new != old and not old.exists(), "the new leader removed the old filter"
    assert not any(session.may_hold(k) for k in keys), "the new leader holds none of them"
    assert old_view._mm.closed, "the old leader's mapping is closed, not kept for the process's life"
    assert old_view.may_hold(hashes(1, seed=5)[0]), "a reader still holding it gets 'maybe' (asks)"
    session.close()
    assert session._presence is not None and session._presence._mm.closed


def test_a_connector_with_the_filter_turned_off_asks_the_leader_for_every_lookup(make_node):
    from kvbm_client.connectors.core import ConnectorSettings
    from kvbm_client.connectors.core.leader_link import LeaderLink
    node = make_node()
    node.ready_client()
    unknown = hashes(3, seed=11)[0]
    links = {on: LeaderLink(ConnectorSettings(node.leader_address, "unix:/unused-{id}", "ns", 5.0, 1.0,
                                              config=node.config(), presence_filter=on)) for on in (True, False)}
    try:
        assert not links[True].may_hold(unknown), "the filter rules out a block the leader never held"
        assert links[False].may_hold(unknown), "turned off: 'maybe' for everything, the leader answers"
    finally:
        for link in links.values():
            link.close()


def _link(node, timeout_s: float, retry_s: float):
    from kvbm_client.connectors.core import ConnectorSettings
    from kvbm_client.connectors.core.leader_link import LeaderLink
    return LeaderLink(ConnectorSettings(node.leader_address, "unix:/unused-{id}", "ns", timeout_s, retry_s,
                                        config=node.config()))


def _timed(call):
    start = time.monotonic()
    answer = call()
    return answer, time.monotonic() - start


def _hits_again(link, keys, never: str) -> None:
    """Lookups through ``link`` until one hits all of ``keys`` (within 15 s, else fail with
    ``never``); the hit is released."""
    end = time.monotonic() + 15
    while (handle := link.prepare_load(keys)) is None:
        assert time.monotonic() < end, never
        time.sleep(0.05)
    assert handle.num_blocks == len(keys)
    link.release(handle)


def test_a_connector_link_never_waits_on_a_leader_that_is_not_up_and_connects_once_it_is(make_node):
    """The scheduler role's link with no leader running: the first lookup pays one attempt (at
    most the timeout); every later one is a miss at once while the retries (each as long as the
    timeout) run on the link's own thread; once the node is up a retry connects and lookups hit.
    Before, each retry ran on the engine's scheduler thread: a stall of the timeout per retry
    period, for as long as the node was down."""
    node = make_node(start=False)
    keys = hashes(3)
    link = _link(node, timeout_s=1.0, retry_s=0.2)
    try:
        first, took = _timed(lambda: link.prepare_load(keys))
        assert first is None and took < 3.0, f"the first attempt took {took:.2f}s (timeout 1 s)"
        slowest, end = 0.0, time.monotonic() + 2.5  # two retries or more, each 1 s
        while time.monotonic() < end:
            answer, took = _timed(lambda: link.prepare_load(keys))
            assert answer is None
            slowest = max(slowest, took)
            time.sleep(0.02)
        assert slowest < 0.5, f"a lookup waited {slowest:.2f}s for a connection attempt (timeout 1 s)"
        node.start()
        client, _ = node.ready_client()
        client.wait(client.offload(keys, [0, 1, 2]))
        _hits_again(link, keys, "the link never connected to the leader that came up")
    finally:
        link.close()


def test_a_hung_leader_costs_the_link_one_timeout_per_retry_period_not_one_per_call(make_node):
    """A leader that stops answering (SIGSTOP) with the link's session open: the call that
    times out fails, the calls within ``retry_s`` after it are misses at once, and once the
    leader answers again the same session serves hits."""
    node = make_node()
    client, _ = node.ready_client()
    keys = hashes(3)
    client.wait(client.offload(keys, [0, 1, 2]))
    link = _link(node, timeout_s=0.5, retry_s=2.0)
    try:
        handle = link.prepare_load(keys)
        assert handle is not None and handle.num_blocks == 3
        link.release(handle)
        node.leader.send_signal(signal.SIGSTOP)
        try:
            assert link.prepare_load(keys) is None  # times out
            for _ in range(10):
                answer, took = _timed(lambda: link.prepare_load(keys))
                assert answer is None and took < 0.25, f"a lookup within the retry period took {took:.2f}s"
        finally:
            node.leader.send_signal(signal.SIGCONT)
        _hits_again(link, keys, "the link never used the leader again")
    finally:
        link.close()
