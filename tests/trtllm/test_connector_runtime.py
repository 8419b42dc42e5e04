"""The replay of TensorRT-LLM's KvCacheConnectorManager: the rules it enforces on a connector."""
from __future__ import annotations

import pytest

from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
)
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm.bindings import LlmRequestState
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

from .connector_runtime import ConnectorContractError, ConnectorRuntime, SchedulerOutputBuilder


class ScriptedScheduler(KvCacheConnectorScheduler):
    def __init__(self, answer=(0, False)):
        super().__init__(TorchLlmArgs())
        self.answer, self.seen, self.meta = answer, [], {"plan": [1, 2]}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.seen.append((request.request_id, request.prompt_len, request.get_tokens(0)))
        getattr(request, "py_request_id")  # the executor's Python attribute: not visible here
        return self.answer

    def update_state_after_alloc(self, request, block_ids):
        self.seen.append(("alloc", request.py_request_id, block_ids))

    def build_connector_meta(self, scheduler_output):
        return self.meta

    def request_finished(self, request, cache_block_ids):
        return True


class ScriptedWorker(KvCacheConnectorWorker):
    def __init__(self):
        super().__init__(TorchLlmArgs())
        self.replies, self.calls = [], []

    def register_kv_caches(self, kv_cache_tensor): ...
    def start_load_kv(self, stream): ...
    def wait_for_layer_load(self, layer_idx, stream): ...
    def save_kv_layer(self, layer_idx, stream): ...
    def wait_for_save(self, stream): ...

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        self.calls.append((finished_gen_req_ids, started_loading_req_ids))
        return self.replies.pop(0) if self.replies else ([], [])


def request(rid=7, prompt=10):
    return LlmRequest(rid, 4, list(range(prompt)))


def runtime(answer=(0, False), ranks=1):
    return ConnectorRuntime(ScriptedScheduler(answer), [ScriptedWorker() for _ in range(ranks)])


def test_match_sees_the_bound_request_only():
    rt = runtime()
    with pytest.raises(AttributeError, match="py_request_id"):
        rt.get_num_new_matched_tokens(request(), 0)
    assert rt.scheduler.seen == [(7, 10, list(range(10)))]


@pytest.mark.parametrize("answer, error", [((0, True), RuntimeError), ((-1, False), ConnectorContractError),
                                           ((2.0, False), ConnectorContractError), (5, ConnectorContractError)])
def test_bad_match_answers_are_rejected(answer, error):
    rt = runtime(answer)
    rt.scheduler.get_num_new_matched_tokens = lambda req, n: answer
    with pytest.raises(error):
        rt.get_num_new_matched_tokens(request(), 0)


def test_metadata_is_the_same_object_on_rank_0_and_a_copy_elsewhere():
    rt = runtime(ranks=2)
    rt.build_scheduler_output([], [], lambda rid: [])
    rt.handle_metadata()
    meta = rt.scheduler.meta
    assert rt.workers[0].get_connector_meta() is meta
    assert rt.workers[1].get_connector_meta() == meta and rt.workers[1].get_connector_meta() is not meta
    rt.workers[0].bind_connector_meta(None)
    rt.handle_metadata()  # nothing built since: nothing bound
    assert rt.workers[0].get_connector_meta() is None


def test_a_save_finishes_only_when_every_rank_reported_it():
    rt = runtime(ranks=2)
    req = request()
    assert rt.request_finished(req, [3, 4]) is True
    assert req.state == LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
    rt.workers[0].replies = [([7], [])]
    assert rt.get_finished() == ([], [])
    assert rt.workers[1].calls == [([7], [])], "each id is handed in once"
    rt.workers[1].replies = [([7], [])]
    saved, _ = rt.get_finished()
    assert saved == [req] and rt.workers[1].calls[-1] == ([], [])
    assert not rt.has_pending_transfers()


def test_an_async_load_parks_the_request_until_every_rank_loaded_it():
    rt = runtime(answer=(8, True), ranks=2)
    rt.scheduler.get_num_new_matched_tokens = lambda req, n: (8, True)
    req = request()
    assert rt.get_num_new_matched_tokens(req, 0) == 8 and rt.is_loading(7)
    assert rt.take_scheduled_requests_pending_load([req]) == []
    assert req.state == LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
    for worker in rt.workers:
        worker.replies = [([], [7])]
    _, loaded = rt.get_finished()
    assert loaded == [req] and req.state == LlmRequestState.CONTEXT_INIT
    assert not rt.should_add_sequence(req), "its sequence exists: it is not added again"


def test_returning_an_id_that_was_not_handed_in_is_a_contract_error():
    rt = runtime()
    rt.workers[0].replies = [([9], [])]
    with pytest.raises(ConnectorContractError, match="request 9"):
        rt.get_finished()


def test_scheduler_output_reports_deltas_and_leaves_connector_tokens_out_once():
    builder = SchedulerOutputBuilder()
    req = request(prompt=20)
    req.set_prepopulated_prompt_len(16, 8)  # 8 device + 8 connector tokens
    builder.record_external_load(7, 8)
    out = builder.build([req], [], set(), lambda rid: [5, 6, 9])
    (data,) = out.new_requests
    assert (data.new_tokens, data.new_block_ids, data.computed_position, data.num_scheduled_tokens) == \
        (list(range(20)), [5, 6, 9], 8, 4)
    req.move_to_next_context_chunk()
    req.add_new_token(99, 0)
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    out = builder.build([], [req], set(), lambda rid: [5, 6, 9])
    (data,) = out.cached_requests
    assert (data.new_tokens, data.new_block_ids, data.computed_position, data.num_scheduled_tokens) == \
        ([99], [], 20, 1)
    assert builder.build([req], [], {7}, lambda rid: [5, 6, 9]).new_requests == [], "a parked request is left out"
