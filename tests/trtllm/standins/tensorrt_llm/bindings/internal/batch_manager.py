"""STAND-IN for ``tensorrt_llm.bindings.internal.batch_manager``: the request object a connector
is handed (``LlmRequest``, the C++ request as nanobind exposes it). Tests only.

Only the attributes a connector reads, and the few the stand-in runtime (``tests/trtllm``)
mutates the way TensorRT-LLM's C++ does, are reproduced; one beam only (the connector path
rejects beam search). Names and read/write-ness follow ``nanobind/batch_manager/bindings.cpp``.
"""
from __future__ import annotations

from enum import Enum
from typing import List, Optional

from tensorrt_llm.bindings import LlmRequestState


class LlmRequestType(Enum):
    LLMREQUEST_TYPE_CONTEXT_AND_GENERATION = 0
    LLMREQUEST_TYPE_CONTEXT_ONLY = 1
    LLMREQUEST_TYPE_GENERATION_ONLY = 2


class LlmRequest:
    """STAND-IN for the bound C++ ``LlmRequest`` (single beam).

    Read by connectors: ``request_id``, ``prompt_len``, ``get_tokens(0)``, ``get_num_tokens(0)``,
    ``max_new_tokens``, ``lora_task_id``, ``cache_salt_id``, ``multimodal_positions``, ``state``,
    ``context_current_position``, ``context_chunk_size``, ``context_remaining_length``,
    ``prepopulated_prompt_len``, ``is_generation_only_request``, ``is_finished``.
    """

    def __init__(self, request_id: int, max_new_tokens: int, input_tokens: List[int], *,
                 lora_task_id: Optional[int] = None, cache_salt_id: Optional[int] = None,
                 llm_request_type: LlmRequestType = LlmRequestType.LLMREQUEST_TYPE_CONTEXT_AND_GENERATION):
        self.request_id = request_id
        self.prompt_len = len(input_tokens)
        self.max_new_tokens = max_new_tokens
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = 0
        self._context_chunk_size = self.prompt_len
        self.is_dummy_request = False
        self._tokens = list(input_tokens)
        self._lora_task_id = lora_task_id
        self._cache_salt_id = cache_salt_id
        self._llm_request_type = llm_request_type
        self._prepopulated_prompt_len = 0

    # --- tokens ---
    def get_tokens(self, beam: Optional[int] = None):
        """``get_tokens(beam)``: this beam's tokens (prompt + generated); ``get_tokens()``: all beams."""
        return list(self._tokens) if beam is not None else [list(self._tokens)]

    def get_num_tokens(self, beam: int) -> int:
        return len(self._tokens)

    def add_new_token(self, token: int, beam: int) -> None:
        self._tokens.append(int(token))

    @property
    def context_chunk_size(self) -> int:
        return self._context_chunk_size

    @context_chunk_size.setter
    def context_chunk_size(self, size: int) -> None:
        """Clamped to the remaining prompt, as C++ ``setContextChunkSize`` does."""
        self._context_chunk_size = min(size, self.prompt_len - self.context_current_position)

    # --- read-only properties ---
    @property
    def lora_task_id(self) -> Optional[int]:
        return self._lora_task_id

    @property
    def cache_salt_id(self) -> Optional[int]:
        """A 64-bit id of the request's cache salt (None without one); different salts must
        never share KV blocks."""
        return self._cache_salt_id

    @property
    def multimodal_positions(self) -> Optional[List[int]]:
        return None

    @property
    def llm_request_type(self) -> LlmRequestType:
        return self._llm_request_type

    @property
    def is_generation_only_request(self) -> bool:
        return self._llm_request_type == LlmRequestType.LLMREQUEST_TYPE_GENERATION_ONLY

    @property
    def is_context_only_request(self) -> bool:
        return self._llm_request_type == LlmRequestType.LLMREQUEST_TYPE_CONTEXT_ONLY

    @property
    def is_finished(self) -> bool:
        return self.state == LlmRequestState.GENERATION_COMPLETE

    @property
    def context_remaining_length(self) -> int:
        return self.prompt_len - self.context_current_position

    @property
    def is_last_context_chunk(self) -> bool:
        return self.context_current_position + self.context_chunk_size >= self.prompt_len

    @property
    def prepopulated_prompt_len(self) -> int:
        return self._prepopulated_prompt_len

    # --- what the C++ runtime does to a request ---
    def move_to_next_context_chunk(self) -> None:
        self.context_current_position += self.context_chunk_size
        self.context_chunk_size = 0

    def set_prepopulated_prompt_len(self, prepopulated_prompt_len: int, kv_tokens_per_block: int) -> None:
        """C++ ``setPrepopulatedPromptLen``: tokens already cached (device match plus connector
        match) move the context position; a chunk that does not reach the end of the prompt is
        shortened to end on a block boundary.

        Raises:
            RuntimeError: ``prepopulated_prompt_len >= prompt_len`` (TensorRT-LLM's check that at
                least one prompt token is computed).
        """
        if prepopulated_prompt_len >= self.prompt_len:
            raise RuntimeError("There must be at least one uncomputed token in the prompt!")
        self._prepopulated_prompt_len = prepopulated_prompt_len
        if prepopulated_prompt_len == 0:
            return
        chunk = self.context_chunk_size
        if prepopulated_prompt_len + chunk < self.prompt_len:
            end = (prepopulated_prompt_len + chunk) // kv_tokens_per_block * kv_tokens_per_block
            if end > prepopulated_prompt_len:
                chunk = end - prepopulated_prompt_len
        self.context_current_position = prepopulated_prompt_len
        self.context_chunk_size = chunk
