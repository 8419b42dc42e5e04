"""A TensorRT-LLM request as the connector core reads it: string id, live token list, extra keys.

Runs on rank 0 (the scheduler role). TensorRT-LLM's ``LlmRequest`` has an ``int`` id that a
new process reuses, and ``get_tokens(0)`` copies the whole list on every call, so the role
keeps its own :class:`TokenView`: filled from the prompt at the lookup, then grown from each
step's ``RequestData.new_tokens``. Blocks are keyed by kvbm's
:class:`~kvbm_client.hashing.BlockIdentity` over these tokens and :func:`request_extras`,
never by the request id.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ...hashing import MultimodalSpan, RequestExtras
from ..core.specs import RequestId

#: Ints per TensorRT-LLM multimodal hash (a 256-bit digest as eight int32, ``hexdigest_to_int32``).
MM_HASH_INTS = 8


@dataclass
class TokenView:
    """The core's :class:`~kvbm_client.connectors.core.request_keys.EngineRequest` of one request.

    Invariant: ``all_token_ids`` only grows, and is the prefix of the request's tokens that
    TensorRT-LLM has reported so far.
    """

    request_id: RequestId
    all_token_ids: list[int]
    extras: RequestExtras | None = field(default=None)

    def catch_up(self, tokens: Sequence[int]) -> None:
        """``tokens`` is the request's whole token list (a new request's ``new_tokens``)."""
        if len(tokens) > len(self.all_token_ids):
            self.all_token_ids.extend(int(t) for t in tokens[len(self.all_token_ids):])

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Tokens appended since the last report (a cached request's ``new_tokens``)."""
        self.all_token_ids.extend(int(t) for t in new_tokens)


def request_id(request: Any) -> RequestId:
    return RequestId(str(request.request_id))


def request_extras(request: Any) -> RequestExtras | None:
    """What besides its tokens decides the request's KV, as TensorRT-LLM's own block key
    (``BlockKey``: LoRA task id, cache salt id, multimodal hashes) folds it; None when a
    multimodal input cannot be identified (kvbm then leaves the request alone).

    ``request`` is the bound ``LlmRequest`` (only its bound attributes are readable); a
    binding that lacks ``cache_salt_id`` has no salts.
    """
    multimodal = multimodal_spans(request)
    if multimodal is None:
        return None
    salt = getattr(request, "cache_salt_id", None)
    lora = getattr(request, "lora_task_id", None)
    return RequestExtras(cache_salt=None if salt is None else f"salt-id:{int(salt)}",
                         lora_name=None if lora is None else f"lora-task:{int(lora)}", multimodal=multimodal)


def multimodal_spans(request: Any) -> tuple[MultimodalSpan, ...] | None:
    """The request's multimodal inputs (``multimodal_hashes`` with ``multimodal_positions`` and
    ``multimodal_lengths``), sorted by position; ``()`` without any; None when they disagree."""
    hashes = getattr(request, "multimodal_hashes", None) or ()
    if not hashes:
        return ()
    positions = getattr(request, "multimodal_positions", None) or ()
    lengths = getattr(request, "multimodal_lengths", None) or ()
    if not len(hashes) == len(positions) == len(lengths):
        return None
    spans = []
    for digest, pos, length in zip(hashes, positions, lengths):
        ints = [int(x) for x in digest]
        if len(ints) != MM_HASH_INTS:
            return None
        hexdigest = "".join(f"{x & 0xFFFFFFFF:08x}" for x in ints)  # TensorRT-LLM's int32_to_hexdigest
        spans.append(MultimodalSpan(hexdigest, int(pos), int(length)))
    return tuple(sorted(spans, key=lambda s: s.offset))
