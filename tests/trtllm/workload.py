"""Deterministic workloads for the driver: what requests arrive, and what follows each answer.

A workload hands the driver its first requests (:meth:`start`) and, whenever a request finishes,
the requests that its answer releases (:meth:`on_finished`). Everything is a function of the seed
and of the output tokens, so two runs whose KV is right produce the same requests and outputs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy as np


@dataclass(frozen=True)
class RequestSpec:
    """One request as a client sends it.

    Attributes:
        name: Unique in the workload (results are keyed by it).
        tokens: The prompt.
        max_new_tokens: Tokens to generate (the only stop condition).
        salt: Cache salt; requests with different salts must never share KV blocks.
        lora_task_id: LoRA adapter (changes the KV, so never shared across adapters either).
    """

    name: str
    tokens: tuple[int, ...]
    max_new_tokens: int
    salt: Optional[str] = None
    lora_task_id: Optional[int] = None


class Workload(Protocol):
    def start(self) -> list[RequestSpec]: ...

    def on_finished(self, spec: RequestSpec, output_tokens: list[int]) -> list[RequestSpec]: ...


class FixedRequests:
    """Every request arrives at once; answers release nothing."""

    def __init__(self, specs: Sequence[RequestSpec]) -> None:
        self._specs = list(specs)

    def start(self) -> list[RequestSpec]:
        return list(self._specs)

    def on_finished(self, spec: RequestSpec, output_tokens: list[int]) -> list[RequestSpec]:
        return []


class Sequential:
    """One request at a time, in the given order (the next arrives when the previous finished)."""

    def __init__(self, specs: Sequence[RequestSpec]) -> None:
        self._queue = deque(specs)

    def start(self) -> list[RequestSpec]:
        return [self._queue.popleft()] if self._queue else []

    def on_finished(self, spec: RequestSpec, output_tokens: list[int]) -> list[RequestSpec]:
        return self.start()


def random_tokens(seed: Sequence[int], n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(list(seed)).integers(0, vocab_size, n))


class Conversations:
    """Multi-round chats: each round's prompt is the previous prompt, its answer and a new turn.

    Conversation ``c`` belongs to tenant ``tenants[c % len(tenants)]`` (its cache salt), and all
    conversations start with the same system prompt, so conversations of a tenant share a prefix
    and tenants share token sequences that must still not share blocks. Rounds are served round
    robin: a finished round's follow-up joins the back of the queue, and ``concurrency`` requests
    are in flight; with more conversations than that, other conversations pass through the device
    between two rounds of one conversation, so a small pool has forgotten its prefix by then.
    """

    def __init__(self, num_conversations: int, rounds: int, system_prompt_len: int, turn_len: int,
                 max_new_tokens: int, tenants: Sequence[Optional[str]] = (None,), concurrency: int = 4,
                 vocab_size: int = 1000, seed: int = 0, lora_task_id: Optional[int] = None) -> None:
        self.rounds, self.turn_len, self.max_new_tokens = rounds, turn_len, max_new_tokens
        self.tenants, self.concurrency = list(tenants), concurrency
        self.vocab_size, self.seed, self.lora_task_id = vocab_size, seed, lora_task_id
        self.system_prompt = random_tokens((seed, 0xC0FFEE), system_prompt_len, vocab_size)
        self._queue = deque(self._spec(c, 0, self.system_prompt) for c in range(num_conversations))

    def start(self) -> list[RequestSpec]:
        return [self._queue.popleft() for _ in range(min(self.concurrency, len(self._queue)))]

    def on_finished(self, spec: RequestSpec, output_tokens: list[int]) -> list[RequestSpec]:
        conversation, round_ = (int(x) for x in spec.name[1:].split("-r"))
        if round_ + 1 < self.rounds:
            self._queue.append(self._spec(conversation, round_ + 1, spec.tokens + tuple(output_tokens)))
        return [self._queue.popleft()] if self._queue else []

    def _spec(self, conversation: int, round_: int, history: tuple[int, ...]) -> RequestSpec:
        turn = random_tokens((self.seed, conversation, round_), self.turn_len, self.vocab_size)
        return RequestSpec(f"c{conversation}-r{round_}", history + turn, self.max_new_tokens,
                           self.tenants[conversation % len(self.tenants)], self.lora_task_id)
