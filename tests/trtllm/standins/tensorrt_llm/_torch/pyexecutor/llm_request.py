"""STAND-IN for ``tensorrt_llm._torch.pyexecutor.llm_request``: the Python subclass of the bound
request that the PyTorch executor works with. Tests only.

The executor hands this subclass to ``update_state_after_alloc`` and ``request_finished``;
``get_num_new_matched_tokens`` is called from C++ and receives the base class only (so the
``py_*`` attributes below are not readable there).
"""
from __future__ import annotations

from typing import List, Optional

from tensorrt_llm.bindings import LlmRequestState  # noqa: F401  (re-exported, as in TensorRT-LLM)
from tensorrt_llm.bindings.internal.batch_manager import LlmRequest as _BoundLlmRequest


class LlmRequest(_BoundLlmRequest):
    """The executor's request: the bound request plus Python-side ``py_*`` attributes."""

    def __init__(self, request_id: int, max_new_tokens: int, input_tokens: List[int], *,
                 client_id: Optional[int] = None, **kwargs):
        super().__init__(request_id, max_new_tokens, input_tokens, **kwargs)
        self.py_request_id = request_id
        self.py_prompt_len = self.prompt_len
        self.py_client_id = client_id
