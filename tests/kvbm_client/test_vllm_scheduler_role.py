"""The vLLM connector's scheduler role as pure logic: a fake leader answers, no vLLM needed
(the package imports ``KvbmConnector`` lazily)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbm_client.connectors.core.settings import ConnectorSettings

BS = 16


@pytest.fixture
def scheduler_module():
    from kvbm_client.connectors.vllm import scheduler
    return scheduler


class FakeLeader:
    """Answers PrepareLoad with ``stored`` leading blocks; records every call (a stand-in for
    the leader link, injected through the role's constructor)."""

    def __init__(self, stored: int) -> None:
        self.stored = stored
        self.calls: list[tuple] = []

    def prepare_load(self, hashes, count_hit=False, tokens_per_block=0, prefill_tokens_per_s=0.0, stage=None):
        self.calls.append(("prepare_load", (hashes,)))
        n = min(self.stored, len(hashes))
        signed = SimpleNamespace(plan=b"plan", signature=b"sig")
        return SimpleNamespace(num_blocks=n, is_empty=n == 0, signed=signed if n else None, deadline=0.0,
                               skipped_cost=0)

    def prepare_store(self, hashes):
        self.calls.append(("prepare_store", (hashes,)))
        return None

    def may_hold(self, key):
        return True  # (no presence filter: every lookup asks)

    def unasked(self, blocks):
        pass

    def release(self, handle):
        self.calls.append(("release", (handle,)))

    def close(self):
        pass


def make(module, mode: str, leader: FakeLeader, **settings_kw):
    settings = ConnectorSettings("unix:/x", "unix:/x-{id}", "ns", 1.0, 1.0, load_mode=mode, **settings_kw)
    return module.KvbmConnectorScheduler(BS, settings, leader=leader)


def request(n_blocks: int, tail: int = 5):
    tokens = list(range(n_blocks * BS + tail))
    return SimpleNamespace(request_id="r1", all_token_ids=tokens, num_tokens=len(tokens), num_computed_tokens=0,
                           cache_salt=None, lora_request=None, mm_features=[], prompt_embeds=None)


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


def vllm_request(**attrs):
    """The attributes vLLM 0.26 / 0.32 ``Request`` objects carry (``mm_features`` entries have
    ``identifier`` and ``mm_position.offset/length``; ``lora_request`` has ``lora_name`` and
    ``lora_path``)."""
    base = dict(request_id="r", all_token_ids=list(range(40)), num_computed_tokens=0, cache_salt=None,
                lora_request=None, mm_features=[], prompt_embeds=None)
    return SimpleNamespace(**{**base, **attrs})


def mm(identifier, offset, length):
    return SimpleNamespace(identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length))


def test_vllm_request_extras_fold_salt_lora_and_images(scheduler_module):
    extras = scheduler_module.request_extras
    assert extras(vllm_request()) == scheduler_module.RequestExtras()
    assert extras(vllm_request(cache_salt="t")).cache_salt == "t"
    assert extras(vllm_request(cache_salt="")).cache_salt is None
    lora = extras(vllm_request(lora_request=SimpleNamespace(lora_name="sql", lora_path="/a/sql", lora_int_id=3)))
    assert (lora.lora_name, lora.lora_path) == ("sql", "/a/sql")
    images = extras(vllm_request(mm_features=[mm("h2", 20, 4), mm("h1", 3, 5)]))
    assert [(s.identifier, s.offset, s.length) for s in images.multimodal] == [("h1", 3, 5), ("h2", 20, 4)]
    older = extras(vllm_request(mm_features=None, mm_hashes=["h1"], mm_positions=[SimpleNamespace(offset=3, length=5)]))
    assert [(s.identifier, s.offset) for s in older.multimodal] == [("h1", 3)]


@pytest.mark.parametrize("attrs", [dict(prompt_embeds=object()), dict(mm_features=[mm(None, 0, 4)]),
                                   dict(mm_features=None, mm_hashes=["h1", "h2"],
                                        mm_positions=[SimpleNamespace(offset=0, length=1)])])
def test_vllm_requests_kvbm_cannot_identify_are_left_alone(scheduler_module, attrs):
    assert scheduler_module.request_extras(vllm_request(**attrs)) is None


@pytest.mark.parametrize("overlapping,defers,expected", [
    (1, False, True),   # one step at a time: nothing in flight can write a reallocated block
    (2, True, True),    # async scheduling on a vLLM that defers block frees past the steps in flight
    (2, False, False),  # async scheduling on a vLLM that reuses freed blocks at once (issue 17 window 4)
])
def test_early_loads_under_overlapping_steps_need_deferred_block_frees(scheduler_module, overlapping, defers,
                                                                       expected):
    on, why = scheduler_module.early_loads_decision(True, True, overlapping, defers)
    assert on is expected and why
    assert scheduler_module.early_loads_decision(False, True, 1, True)[0] is False, "early_loads: false wins"
    assert scheduler_module.early_loads_decision(True, False, 1, True)[0] is False, "no worker to send to"


def test_the_role_starts_early_loads_only_where_the_decision_allows(scheduler_module, monkeypatch):
    monkeypatch.setattr(scheduler_module, "EarlyLoads", lambda settings, workers: SimpleNamespace(close=lambda: None))
    settings = ConnectorSettings("unix:/x", "unix:/x-{id}", "ns", 1.0, 1.0, load_mode="sync")
    off = scheduler_module.KvbmConnectorScheduler(BS, settings, ["0"], leader=FakeLeader(0), overlapping_steps=2)
    on = scheduler_module.KvbmConnectorScheduler(BS, settings, ["0"], leader=FakeLeader(0), overlapping_steps=2,
                                                 defers_block_frees=True)
    try:
        assert not off.early_loads and off.core._early is None
        assert on.early_loads and on.core._early is not None
    finally:
        on.core.shutdown()
        off.core.shutdown()


class StoringLeader(FakeLeader):
    """Plans a store of every block it is offered (deadline far ahead)."""

    def prepare_store(self, hashes):
        self.calls.append(("prepare_store", (hashes,)))
        signed = SimpleNamespace(plan=b"store", signature=b"sig")
        return SimpleNamespace(num_blocks=len(hashes), is_empty=not hashes, indices=tuple(range(len(hashes))),
                               signed=signed, deadline=1e12)


class VllmPool:
    """vLLM's ``BlockPool`` as the role uses it: ``blocks`` by id, ``touch`` adds a reference,
    ``free_blocks`` drops one (recording the order)."""

    def __init__(self, n: int) -> None:
        self.blocks = [SimpleNamespace(block_id=i, ref_cnt=0) for i in range(n)]
        self.freed: list[int] = []

    def touch(self, blocks):
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks):
        for b in blocks:
            assert b.ref_cnt > 0
            b.ref_cnt -= 1
            self.freed.append(b.block_id)


def test_with_vllms_block_pool_a_finished_request_frees_at_once_and_the_worker_reports_unpin_its_stored_blocks(
        scheduler_module):
    from kvbm_client.connectors.vllm.metadata import KvbmWorkerMetadata
    # (the step's stores planned on this thread: they ship with it; planned stores are held from the ask,
    # test_store_planner)
    role = make(scheduler_module, "sync", StoringLeader(stored=0), async_decode_store_plans=False)
    pool = VllmPool(8)
    role.bind_block_pool(pool, reporters=2)
    req = request(3, tail=0)
    req.num_tokens = 3 * BS
    role.get_num_new_matched_tokens(req, 0)
    out = SimpleNamespace(preempted_req_ids=(), scheduled_new_reqs=[SimpleNamespace(req_id="r1", block_ids=([4, 5, 6],))],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[]), num_scheduled_tokens={"r1": 3 * BS})
    (store,) = role.build_connector_meta(out).stores
    assert [b.ref_cnt for b in pool.blocks[4:7]] == [1, 1, 1] and role.has_pending_push_work()
    assert role.request_finished(req, [4, 5, 6]) == (False, None), "freed at once: the pool pins what the store reads"
    two = KvbmWorkerMetadata((store.store_id,)).aggregate(KvbmWorkerMetadata(()))
    role.update_connector_output(SimpleNamespace(kv_connector_worker_meta=two))
    assert pool.freed == [] and role.has_pending_push_work(), "one of the two worker roles reported"
    role.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KvbmWorkerMetadata((store.store_id,))))
    assert pool.freed == [6, 5, 4], "unpinned tail first, as vLLM frees a request's blocks"
    assert not role.has_pending_push_work()
