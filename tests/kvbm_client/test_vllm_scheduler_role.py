"""The vLLM connector's scheduler role as pure logic: a fake leader answers, no vLLM needed
(the package imports ``KvbmConnector`` lazily)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

BS = 16


@pytest.fixture
def scheduler_module():
    from kvbm_client.connectors.vllm import scheduler
    return scheduler


class FakeLeader:
    """Answers PrepareLoad with ``stored`` leading blocks; records every call."""

    def __init__(self, stored: int) -> None:
        self.stored = stored
        self.calls: list[tuple] = []

    def __call__(self, name: str, *args, **kwargs):
        self.calls.append((name, args))
        if name != "prepare_load":
            return None
        n = min(self.stored, len(args[0]))
        signed = SimpleNamespace(plan=b"plan", signature=b"sig")
        return SimpleNamespace(num_blocks=n, is_empty=n == 0, signed=signed if n else None)


def make(module, mode: str, leader: FakeLeader):
    settings = module.ConnectorSettings("unix:/x", "unix:/x-{id}", "ns", 1.0, 1.0, load_mode=mode)
    role = module.KvbmConnectorScheduler(BS, settings)
    role._call = leader
    return role


def request(n_blocks: int, tail: int = 5):
    return SimpleNamespace(request_id="r1", block_hashes=[bytes([i]) * 32 for i in range(n_blocks)],
                           num_tokens=n_blocks * BS + tail)


@pytest.mark.parametrize("mode,is_async", [("sync", False), ("async", True)])
def test_a_hit_is_planned_once_and_loaded_into_the_allocated_blocks(scheduler_module, mode, is_async):
    leader = FakeLeader(stored=6)
    role = make(scheduler_module, mode, leader)
    req = request(8)
    assert role.get_num_new_matched_tokens(req, 2 * BS) == (6 * BS, is_async)  # 2 local, 6 from kvbm
    assert role.get_num_new_matched_tokens(req, 2 * BS) == (6 * BS, is_async)  # asked again: no new RPC
    assert [c[0] for c in leader.calls] == ["prepare_load"]
    assert len(leader.calls[0][1][0]) == 6, "asked for the blocks after the local prefix"
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 20, 21, 22, 23, 24, 25, 26],))
    role.update_state_after_alloc(req, blocks, 6 * BS)
    meta = role.build_connector_meta(SimpleNamespace(preempted_req_ids=(), scheduled_new_reqs=[],
                                                     scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                                                     num_scheduled_tokens={}))
    (spec,) = meta.loads
    assert spec.engine_blocks == [20, 21, 22, 23, 24, 25] and spec.sync is (not is_async)


def test_a_miss_is_not_asked_again_while_the_request_waits(scheduler_module):
    leader = FakeLeader(stored=0)
    role = make(scheduler_module, "sync", leader)
    req = request(8)
    for _ in range(3):  # vLLM asks every step while the request waits for G1 space
        assert role.get_num_new_matched_tokens(req, 0) == (0, False)
    assert len(leader.calls) == 1
    assert role.get_num_new_matched_tokens(req, BS) == (0, False)  # a new local prefix: ask again
    assert len(leader.calls) == 2


def test_at_least_one_prompt_token_is_left_to_compute(scheduler_module):
    leader = FakeLeader(stored=100)
    role = make(scheduler_module, "sync", leader)
    req = request(8, tail=0)  # a prompt of exactly 8 full blocks
    assert role.get_num_new_matched_tokens(req, 0) == (7 * BS, False)
