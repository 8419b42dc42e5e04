"""The engine's prefill speed, measured on the connector's scheduler side from step times.

Runs on the engine's scheduler thread; pure (the caller passes the clock). The estimate goes
with every lookup to the leader (``PrepareLoadRequest.prefill_tokens_per_s``), which loads a
hit only as far as loading beats recomputing it (:mod:`kvbm_leader.onboard_cost`).

A step's time is from when the engine scheduled it (:meth:`PrefillMeter.scheduled`, vLLM's
``build_connector_meta``) to when its output came back (:meth:`PrefillMeter.finished`,
``update_connector_output``), starting no earlier than the previous step's end: with
asynchronous scheduling a step is scheduled while the one before it still runs, and an idle
engine schedules nothing, so neither queueing nor idle time counts. Only steps of at least
:data:`MIN_PREFILL_TOKENS` tokens are samples: a decode step's time is its weight reads, not
its tokens, and would make prefill look slow. A mixed step (a prefill chunk with decodes)
counts its decodes as prefill tokens: close enough, and it errs toward loading.

Until a step was measured the estimate is the configured prior
(``DYN_KVBM_PREFILL_TOKENS_PER_S``; 0: unknown, the leader then loads every hit, as before).
An engine adapter without a step-end hook (TensorRT-LLM) uses the prior only.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ...estimators import RateEstimator

#: Fewest tokens in a step for its time to count as prefill speed.
MIN_PREFILL_TOKENS = 256
#: Steps scheduled and not finished that the meter remembers (vLLM runs at most 2 at once).
MAX_OPEN_STEPS = 4


@dataclass
class PrefillMeter:
    """Owns the open steps (scheduled, output not back yet) and the tokens/s estimate.

    Invariants: at most :data:`MAX_OPEN_STEPS` open steps (older ones are forgotten, never
    measured); :attr:`tokens_per_s` is 0 (unknown) or > 0.
    """

    prior: float = 0.0
    estimate: RateEstimator = field(init=False)
    _open: collections.deque[tuple[float, int]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_OPEN_STEPS))
    _last_end: float = float("-inf")

    def __post_init__(self) -> None:
        self.estimate = RateEstimator(self.prior)

    @property
    def tokens_per_s(self) -> float:
        return self.estimate.rate

    def scheduled(self, num_tokens: int, now: float) -> None:
        """The engine scheduled a step of ``num_tokens`` tokens at ``now``."""
        self._open.append((now, num_tokens))

    def finished(self, now: float) -> None:
        """The oldest open step's output came back at ``now`` (one call per step, in order)."""
        if not self._open:
            return
        start, tokens = self._open.popleft()
        began = max(start, self._last_end)
        self._last_end = now
        if tokens >= MIN_PREFILL_TOKENS:
            self.estimate.observe(tokens, now - began)
