"""Persistent G3 across crashes: kill -9 of a worker or of the leader in the middle of offloads
(two workers, a G3 small enough that slots are rewritten all the time, writes slowed half way so
that kills land inside them), then a restart: every block that matches loads exactly the bytes
stored for it, on every rank."""
from __future__ import annotations

import signal
import time

from support.fault_env import fault_env
from support.persist_blocks import OffloadLoop, counter, load_and_check, wait_for

# Test-only fault: every G3 write stops half way for 30 ms, so most kills land in a torn write.
PERSIST = dict(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="40",
               DYN_KVBM_DISK_PERSIST="true", **fault_env(DISK_SLOW_WRITE_SECS="0.03"))


def check_everything(client, engines, offered) -> int:  # type: ignore[no-untyped-def]
    """Load every matchable block ever offered and check its bytes; returns how many matched."""
    return sum(load_and_check(client, engines, keys, range(16, 16 + len(keys))) for keys in offered)


def run_until_killed(client, engines, kill, after: float, seed: int) -> OffloadLoop:  # type: ignore[no-untyped-def]
    """Offload until ``kill()`` ran ``after`` seconds into a full G3; returns the loop."""
    loop = OffloadLoop(client, engines, seed=seed).start()
    wait_for(lambda: loop.stored >= 6, what="offloads before the kill")  # G3 is full: slots get rewritten
    time.sleep(after)
    kill()
    loop.stop()
    return loop


def test_kill_9_worker_during_offloads_restores_only_right_bytes(make_node):
    node = make_node(num_workers=2, **PERSIST)
    client, engines = node.ready_client()
    offered: list = []
    before = 0.0
    for cycle, after in enumerate((0.13, 0.41)):
        loop = run_until_killed(client, engines, lambda: node.signal_worker("1", signal.SIGKILL), after,
                                seed=1000 * (cycle + 1))
        offered += loop.offered
        node.start_worker("1")
        node.wait_attached()
        client.register_region("1", engines["1"].spec())
        client.wait_ready(30)
        restored = counter(node, "kvbm_g3_restored_blocks") - before
        before += restored
        assert restored >= 8, f"cycle {cycle}: {restored} blocks restored after {loop.stored} batches"
        assert 8 <= check_everything(client, engines, offered) <= restored
    assert "wrong bytes" not in node.log_tails(100_000)


def test_kill_9_leader_during_offloads_restores_only_right_bytes(make_node):
    node = make_node(num_workers=2, **PERSIST)
    client, engines = node.ready_client()
    offered: list = []
    for cycle, after in enumerate((0.07, 0.29)):
        loop = run_until_killed(client, engines, lambda: node.kill(node.leader, signal.SIGKILL), after,
                                seed=1000 * (cycle + 1))
        offered += loop.offered
        node.start_leader()
        node.wait_ready()  # the workers re-attached, with their regions: the client opens a new session
        client.wait_ready(30)
        restored = counter(node, "kvbm_g3_restored_blocks")  # a new leader counts from 0
        assert restored >= 8, f"cycle {cycle}: {restored} blocks restored after {loop.stored} batches"
        assert 8 <= check_everything(client, engines, offered) <= restored
