"""Command acknowledgements over NATS are the worker's word only (issue 11 row 12).

Any NATS client allowed on ``kvbm.v1.commands.<node>.<worker>`` can answer a demotion. A
rogue that answers first with an acknowledgement it cannot sign must neither commit the job
(nor free its slots before the job expires) nor hide the genuine worker's answer.
Real nats-server, real leader and worker processes.
"""
from __future__ import annotations

import signal
import time

from cluster_support import NatsSubscriber, wait_for
from kvbm_client import sequence_hashes
from kvbm_client.contract import pb


def keys_of(n: int, seed: int) -> list[bytes]:
    return sequence_hashes([seed * 100_003 + i for i in range(n * 16)], 16)


class RogueResponder(NatsSubscriber):
    """Subscribes to a worker's command subject and answers every command at once with a
    forged acknowledgement (ok, right worker and job, a signature it had to invent)."""

    def __init__(self, url: str, subject: str) -> None:
        self.answered: list[int] = []
        super().__init__(url, subject)

    async def on_msg(self, msg) -> None:
        request = pb.CommandRequest()
        request.ParseFromString(msg.data)
        plan = pb.TransferPlan()
        plan.ParseFromString(request.plan.plan)
        forged = pb.CommandResponse(ok=True, worker_id="0", job_id=plan.job_id, signature=b"\x00" * 32)
        await msg.respond(forged.SerializeToString())
        self.answered.append(plan.job_id)


def counters(node) -> dict:
    return dict(node.status().counters)


def g3_used(node) -> int:
    return next(t.used_blocks for t in node.status().tiers if t.tier == 3)


def _node(make_cluster_node, nats_server):
    return make_cluster_node("a", nats=nats_server, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="8",
                             DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="16", DYN_KVBM_HOST_FREE_WATERMARK="0.5",
                             DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER="true")


def test_a_forged_ack_does_not_hide_the_genuine_one(nats_server, make_cluster_node):
    node = _node(make_cluster_node, nats_server)
    client, _ = node.ready_client()
    rogue = RogueResponder(nats_server.url, "kvbm.v1.commands.a.0")
    try:
        client.wait(client.offload(keys_of(8, 1), list(range(8))))  # G2 full: the leader demotes
        wait_for(lambda: rogue.answered, 10, "the rogue answered a demotion")
        # The job commits on the worker's signed acknowledgement, well before it would expire.
        wait_for(lambda: counters(node)["kvbm_offload_blocks_h2d"] >= 1, 2.5, "demotion committed")
        assert counters(node)["kvbm_commands_undelivered"] == 0
        assert "not signed by the worker" in (node.root / "leader.log").read_text()
    finally:
        rogue.close()


def test_a_forged_ack_alone_commits_nothing_and_frees_nothing(nats_server, make_cluster_node):
    node = _node(make_cluster_node, nats_server)
    client, _ = node.ready_client()
    client.wait(client.offload(keys_of(4, 1), [0, 1, 2, 3]))  # G2 half full: at the watermark
    assert g3_used(node) == 0
    rogue = RogueResponder(nats_server.url, "kvbm.v1.commands.a.0")
    worker = node.workers["0"]
    worker.send_signal(signal.SIGSTOP)  # only the rogue can answer now
    try:
        assert client.prepare_store(keys_of(2, 2)).num_blocks == 2  # two pending slots: below the watermark
        wait_for(lambda: rogue.answered, 10, "the rogue answered a demotion")
        demoted = g3_used(node)
        assert demoted >= 1
        t_end = time.monotonic() + 1.5  # inside the job's deadline (3 s) and grace
        while time.monotonic() < t_end:
            assert counters(node)["kvbm_offload_blocks_h2d"] == 0, "a forged ack committed the demotion"
            assert g3_used(node) == demoted, "the demotion's slots were freed before it expired"
            time.sleep(0.1)
        # Expired (deadline + grace): rolled back, its G3 slots free again, nothing committed.
        wait_for(lambda: g3_used(node) == 0, 15, "the demotion expired")
        assert counters(node)["kvbm_offload_blocks_h2d"] == 0
        assert counters(node)["kvbm_failed_jobs"] >= 1
    finally:
        worker.send_signal(signal.SIGCONT)
        rogue.close()
