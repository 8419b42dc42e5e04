"""Online rate estimates (bytes/s of a tier's loads, tokens/s of an engine's prefill), pure.

Shared by the leader (per-tier load bandwidth, :mod:`kvbm_leader.onboard_cost`) and the
connector's scheduler side (prefill speed, :mod:`kvbm_client.connectors.core.prefill`). No
clock and no I/O: the caller measures and passes ``amount`` and ``seconds``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["RateEstimator"]


@dataclass(slots=True)
class RateEstimator:
    """A rate (amount per second) learned from samples: an EWMA of ``log(rate)`` that starts at
    ``prior``.

    Why log space: rates are positive and their errors multiplicative (a disk at half speed
    is as wrong as one at twice the speed), and the geometric mean is never pulled to zero
    or infinity by one sample.

    Invariants:

    * :attr:`rate` is finite and > 0 (or exactly 0 when ``prior`` is 0 and nothing was
      observed yet: "unknown").
    * The first ``warmup`` samples are averaged with the prior as one more sample (the first
      sample is the estimate when there is no prior), so a wrong prior is forgotten after a few measurements; after them each
      sample weighs ``alpha`` and moves the estimate by at most a factor ``clip ** alpha``
      (a sample beyond ``clip`` times the estimate counts as ``clip`` times it): an outlier
      (a page-cache hit, a stalled disk, an idle engine) cannot swing a decision.
    * Samples that are not finite or not positive (``amount <= 0`` or ``seconds <= 0``) are
      ignored and change nothing.
    """

    prior: float
    alpha: float = 0.2
    clip: float = 4.0
    warmup: int = 3
    #: samples taken into the estimate
    samples: int = 0
    _log: float = 0.0

    def __post_init__(self) -> None:
        assert self.prior >= 0 and math.isfinite(self.prior), f"prior must be finite and >= 0, got {self.prior}"
        assert 0 < self.alpha <= 1 and self.clip > 1 and self.warmup >= 0, "alpha in (0, 1], clip > 1, warmup >= 0"
        if self.prior > 0:
            self._log = math.log(self.prior)

    @property
    def rate(self) -> float:
        """The current estimate (amount per second); 0 when unknown (no prior, no sample)."""
        if self.samples == 0:
            return self.prior  # exactly (not exp(log(prior)))
        return math.exp(self._log)

    @property
    def measured(self) -> bool:
        return self.samples > 0

    def observe(self, amount: float, seconds: float) -> bool:
        """Take one measurement (``amount`` moved in ``seconds``); False when it was ignored."""
        if not (math.isfinite(amount) and math.isfinite(seconds) and amount > 0 and seconds > 0):
            return False
        sample = math.log(amount / seconds)
        if self.samples < self.warmup or self.samples == 0 == self.prior:  # the mean so far (with the prior if any)
            self._log += (sample - self._log) / (self.samples + (2 if self.prior > 0 else 1))
        else:
            bound = math.log(self.clip)
            self._log += self.alpha * max(-bound, min(bound, sample - self._log))
        self.samples += 1
        return True

    def seconds_for(self, amount: float) -> float:
        """Expected seconds to move ``amount`` (infinite when the rate is unknown)."""
        rate = self.rate
        return amount / rate if rate > 0 else math.inf
