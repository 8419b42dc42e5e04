"""Which requests run in the next forward pass: TensorRT-LLM's request scheduler, reduced.

* Capacity, ``GUARANTEED_NO_EVICT`` (the only policy TensorRT-LLM allows with a KV connector): a
  request is admitted only when the free blocks, less the blocks every admitted request may still
  claim, cover its whole life (``ceil((prompt_len + max_new_tokens) / tokens_per_block)``);
  once admitted it is never preempted. Blocks held by a finished request whose connector save is
  in flight are not free.
* Micro batch: at most ``max_batch_size`` requests and ``max_num_tokens`` tokens; a generation
  step costs one token, a context chunk its length. Without chunked prefill a prompt that does not
  fit the remaining budget waits; with it the chunk is cut to the budget, on a block boundary.

Parked requests (asynchronous connector load in flight) are not schedulable. Pure: decides and
sets ``context_chunk_size``, nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from tensorrt_llm.bindings import LlmRequestState


@dataclass
class ScheduledBatch:
    context_requests: list = field(default_factory=list)
    generation_requests: list = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    def all_requests(self) -> list:
        return self.context_requests + self.generation_requests


class BatchScheduler:
    """Capacity + micro-batch scheduling over the active requests, in arrival order.

    Args:
        num_free_blocks: Free blocks of the device pool right now.
        blocks_held: Blocks a request holds now (0 before it has a sequence).
    """

    def __init__(self, tokens_per_block: int, max_batch_size: int, max_num_tokens: int,
                 enable_chunked_prefill: bool, num_free_blocks: Callable[[], int],
                 blocks_held: Callable[[int], int]) -> None:
        self.tokens_per_block, self.max_batch_size = tokens_per_block, max_batch_size
        self.max_num_tokens, self.enable_chunked_prefill = max_num_tokens, enable_chunked_prefill
        self._num_free_blocks, self._blocks_held = num_free_blocks, blocks_held
        self._admitted: dict[int, int] = {}  # request id -> lifetime blocks

    def lifetime_blocks(self, request) -> int:
        return -(-(request.prompt_len + request.max_new_tokens) // self.tokens_per_block)

    def forget(self, request_id: int) -> None:
        """The request's sequence was released (or never allocated)."""
        self._admitted.pop(request_id, None)

    def schedule(self, active: Sequence) -> ScheduledBatch:
        batch, budget = ScheduledBatch(), self.max_num_tokens
        for req in active:
            if batch.batch_size >= self.max_batch_size:
                break
            if req.state == LlmRequestState.GENERATION_IN_PROGRESS and budget >= 1:
                batch.generation_requests.append(req)
                budget -= 1
        for req in active:
            if batch.batch_size >= self.max_batch_size or budget <= 0:
                break
            if req.state != LlmRequestState.CONTEXT_INIT or not self._admit(req):
                continue
            chunk = self._chunk(req.context_remaining_length, budget)
            if chunk == 0:
                continue
            req.context_chunk_size = chunk
            batch.context_requests.append(req)
            budget -= chunk
        return batch

    def _admit(self, req) -> bool:
        if req.request_id in self._admitted:
            return True
        claimable = sum(life - self._blocks_held(rid) for rid, life in self._admitted.items())
        need = self.lifetime_blocks(req)
        if self._num_free_blocks() - claimable < need:
            return False
        self._admitted[req.request_id] = need
        return True

    def _chunk(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        if not self.enable_chunked_prefill:
            return 0
        return budget // self.tokens_per_block * self.tokens_per_block
