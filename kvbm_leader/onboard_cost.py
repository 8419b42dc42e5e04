"""Cost-aware onboarding: load a matched prefix only as far as loading beats recomputing it.

Runs in the leader; pure and synchronous (the caller measures and passes times).

Who decides, and why the leader: ``PrepareLoad`` already walks the matched prefix and knows
each block's tier, and the leader sees every load job's report (bytes and seconds on the
worker's lane) and every promotion's acknowledgement, so the per-tier load bandwidth is
measured here. The engine side knows how fast its engine prefills: the connector's
scheduler role sends its estimate (``PrepareLoadRequest.prefill_tokens_per_s``, measured
from step times, :mod:`kvbm_client.connectors.core.prefill`). Deciding in the leader keeps a
hit one round trip and never pins blocks only to release them; a client that sends no
estimate (0: tools, old connectors, ``DYN_KVBM_COST_AWARE_LOADS=false``) gets every matched
block loaded, the behaviour before this module.

The decision, over a matched prefix of ``n`` blocks with tiers ``t_0 .. t_{n-1}``: load the
first ``k`` blocks and recompute the other ``n - k``, with ``k`` minimising

    load_s(k) + (n - k) * recompute_s_per_block
    load_s(k) = sum over i < k of shard_bytes / bandwidth(t_i)
    recompute_s_per_block = tokens_per_block / prefill_tokens_per_s

Only a prefix is ever loaded (a block whose predecessor is not loaded is useless to the
engine), so a G2 head followed by a slow G3 tail loads the head; a slow G3 block followed by
many G2 blocks is loaded when the G2 blocks after it pay for it. Ties load (the old
behaviour, and a load costs the GPU no compute). Workers copy their shards in parallel, so
``shard_bytes`` is the largest worker's shard of a block. Recompute is taken as linear in
tokens (attention over a long prefix makes the true cost grow a little with position: the
estimate errs toward loading). The matched G3 blocks that are not loaded are promoted to G2
by the caller (:meth:`~.rebalancer.Rebalancer.maybe_promote`), so the next hit is fast.

Bandwidth samples: a LOAD job of one tier (one sample per worker report: its shard bytes
over its lane seconds) and a promotion (G3 -> G2: disk reads, the part a G3 load waits for;
its bytes over the command's round trip). A job that reads both tiers gives no sample (its
time cannot be split). Priors: ``DYN_KVBM_HOST_LOAD_GBPS`` (20, an H100's pinned-host to GPU
copies) and ``DYN_KVBM_DISK_LOAD_GBPS`` (2, an H100 node's NVMe through the bounce buffer).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from kvbm_client.estimators import RateEstimator
from kvbm_client.ids import Tier


class OnboardReason(str, enum.Enum):
    """Why a matched prefix was loaded as it was (the ``reason`` label of ``kvbm_onboard_decisions``)."""

    #: loading every matched block is the cheapest
    LOAD = "load"
    #: a head is loaded, the tail recomputed (its load would be slower)
    PARTIAL = "partial"
    #: nothing is loaded: recomputing the whole match is faster
    RECOMPUTE = "recompute"
    #: the client sent no prefill estimate: every matched block is loaded (no cost check)
    UNCHECKED = "unchecked"


@dataclass(frozen=True, slots=True)
class OnboardDecision:
    """How much of a matched prefix to load, with the estimates behind it (for the debug line)."""

    num_matched: int
    num_load: int
    reason: OnboardReason
    #: expected seconds to load the chosen head, and the whole match
    load_s: float = 0.0
    load_all_s: float = 0.0
    #: expected seconds to recompute the whole match
    recompute_s: float = 0.0

    @property
    def num_skipped(self) -> int:
        return self.num_matched - self.num_load


def choose_prefix(tiers: Sequence[Tier], seconds_per_block: Mapping[Tier, float],
                  recompute_s_per_block: float) -> OnboardDecision:
    """The head of ``tiers`` worth loading (see the module docstring). ``seconds_per_block``
    gives each tier's expected load time of one block (infinite: never load from it)."""
    n = len(tiers)
    best_k, best_cost, loaded = 0, n * recompute_s_per_block, 0.0
    load_s = 0.0
    for k, tier in enumerate(tiers, start=1):
        loaded += seconds_per_block[tier]
        cost = loaded + (n - k) * recompute_s_per_block
        if cost <= best_cost:  # ties load
            best_k, best_cost, load_s = k, cost, loaded
    reason = (OnboardReason.LOAD if best_k == n else
              OnboardReason.RECOMPUTE if best_k == 0 else OnboardReason.PARTIAL)
    return OnboardDecision(n, best_k, reason, load_s, loaded, n * recompute_s_per_block)


@dataclass
class OnboardCosts:
    """The leader's load-bandwidth estimates per tier, and the decision of :func:`choose_prefix`.

    Owned by the leader service; fed by the ledger (load reports) and the rebalancer
    (promotions); read by the planner. Invariant: every tier has an estimate > 0 (its prior
    until measured).
    """

    host_bytes_per_s: float = 20e9
    disk_bytes_per_s: float = 2e9
    bandwidth: dict[Tier, RateEstimator] = field(init=False)

    def __post_init__(self) -> None:
        assert self.host_bytes_per_s > 0 and self.disk_bytes_per_s > 0, "bandwidth priors must be > 0"
        self.bandwidth = {Tier.HOST: RateEstimator(self.host_bytes_per_s),
                          Tier.DISK: RateEstimator(self.disk_bytes_per_s)}

    def observe_load(self, tiers: Sequence[Tier], nbytes: int, seconds: float) -> bool:
        """One worker's report of a LOAD job; a sample only when the job read one tier."""
        kinds = set(tiers)
        if len(kinds) != 1:
            return False
        return self.bandwidth[kinds.pop()].observe(nbytes, seconds)

    def observe_promotion(self, nbytes: int, seconds: float) -> bool:
        """A promotion (G3 -> G2) took ``seconds`` for ``nbytes`` per worker: a G3 read sample."""
        return self.bandwidth[Tier.DISK].observe(nbytes, seconds)

    def rates(self) -> dict[Tier, float]:
        return {tier: est.rate for tier, est in self.bandwidth.items()}

    def decide(self, tiers: Sequence[Tier], shard_bytes: int, tokens_per_block: int,
               prefill_tokens_per_s: float) -> OnboardDecision:
        """How much of a matched prefix (``tiers``) to load. No estimate from the client
        (``prefill_tokens_per_s`` or ``tokens_per_block`` not > 0) or no known block size:
        load everything (:attr:`OnboardReason.UNCHECKED`)."""
        n = len(tiers)
        if not (prefill_tokens_per_s > 0 and tokens_per_block > 0 and shard_bytes > 0) \
                or not math.isfinite(prefill_tokens_per_s):
            return OnboardDecision(n, n, OnboardReason.UNCHECKED)
        per_block = {tier: est.seconds_for(shard_bytes) for tier, est in self.bandwidth.items()}
        return choose_prefix(tiers, per_block, tokens_per_block / prefill_tokens_per_s)
