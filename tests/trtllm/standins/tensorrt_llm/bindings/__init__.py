"""STAND-IN for ``tensorrt_llm.bindings``: the request states a connector may read."""
from enum import Enum


class LlmRequestState(Enum):
    """``tensorrt_llm.bindings.LlmRequestState`` (the states the connector path uses).

    ``DISAGG_GENERATION_TRANS_IN_PROGRESS`` parks a request whose KV is being loaded
    asynchronously by the connector; ``DISAGG_CONTEXT_TRANS_IN_PROGRESS`` marks a finished
    request whose blocks the connector is still saving (their free is delayed).
    """

    CONTEXT_INIT = "CONTEXT_INIT"
    GENERATION_IN_PROGRESS = "GENERATION_IN_PROGRESS"
    GENERATION_TO_COMPLETE = "GENERATION_TO_COMPLETE"
    GENERATION_COMPLETE = "GENERATION_COMPLETE"
    DISAGG_GENERATION_TRANS_IN_PROGRESS = "DISAGG_GENERATION_TRANS_IN_PROGRESS"
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = "DISAGG_CONTEXT_TRANS_IN_PROGRESS"
