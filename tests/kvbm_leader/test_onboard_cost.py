"""Cost-aware onboarding: the prefix worth loading over mixed tiers, its boundaries, the
bandwidth samples the leader takes."""
import math

import pytest

from kvbm_client.ids import Tier
from kvbm_leader.onboard_cost import OnboardCosts, OnboardReason, choose_prefix

H, D = Tier.HOST, Tier.DISK
FAST = {H: 1.0, D: 10.0}  # seconds per block; recompute costs 5 per block below


@pytest.mark.parametrize("tiers,num_load,reason", [
    ([H, H, H], 3, OnboardReason.LOAD),
    ([D, D], 0, OnboardReason.RECOMPUTE),
    ([H, H, D, D], 2, OnboardReason.PARTIAL),          # G2 head loaded, G3 tail recomputed
    ([H, D, H, H, H, H, H, H], 8, OnboardReason.LOAD),  # the G2 blocks after the G3 one pay for it
    ([H, D, H], 1, OnboardReason.PARTIAL),              # ... unless they are too few
    ([D, H, H, H, H, H], 6, OnboardReason.LOAD),
    ([], 0, OnboardReason.LOAD),
])
def test_prefix_over_mixed_tiers(tiers: list[Tier], num_load: int, reason: OnboardReason) -> None:
    d = choose_prefix(tiers, FAST, 5.0)
    assert (d.num_load, d.reason, d.num_skipped) == (num_load, reason, len(tiers) - num_load)
    assert d.load_s == pytest.approx(sum(FAST[t] for t in tiers[:num_load]))
    assert d.recompute_s == pytest.approx(5.0 * len(tiers))


def test_boundary_ties_load_and_a_hair_more_recomputes() -> None:
    assert choose_prefix([D, D], {H: 1.0, D: 5.0}, 5.0).num_load == 2
    assert choose_prefix([D, D], {H: 1.0, D: 5.0 + 1e-9}, 5.0).num_load == 0
    assert choose_prefix([D], {H: 1.0, D: math.inf}, 5.0).num_load == 0


def test_decide_from_priors_h100_figures() -> None:
    """The issue's numbers: a 2 MiB shard per 16-token block, prefill at 33K tokens/s: G2 at
    20 GB/s loads (0.1 ms vs 0.48 ms), G3 at 2 GB/s does not (1.05 ms)."""
    costs = OnboardCosts()
    d = costs.decide([H] * 10 + [D] * 20, 2 << 20, 16, 33_000)
    assert (d.num_load, d.reason) == (10, OnboardReason.PARTIAL)
    assert costs.decide([D] * 20, 2 << 20, 16, 1000).reason is OnboardReason.LOAD  # a slow engine loads


@pytest.mark.parametrize("shard,tokens,rate", [(2 << 20, 16, 0.0), (2 << 20, 0, 33_000.0), (0, 16, 33_000.0),
                                               (2 << 20, 16, math.inf), (2 << 20, 16, -1.0)])
def test_no_estimate_loads_everything(shard: int, tokens: int, rate: float) -> None:
    d = OnboardCosts().decide([D, D, D], shard, tokens, rate)
    assert (d.num_load, d.reason) == (3, OnboardReason.UNCHECKED)


def test_samples_come_from_single_tier_loads_and_promotions() -> None:
    costs = OnboardCosts(host_bytes_per_s=20e9, disk_bytes_per_s=2e9)
    assert not costs.observe_load([H, D], 1 << 30, 1.0)  # mixed: its time cannot be split
    assert costs.rates() == {H: 20e9, D: 2e9}
    assert costs.observe_load([H, H], 10 << 30, 1.0)
    assert costs.rates()[H] != 20e9 and costs.rates()[D] == 2e9
    assert costs.observe_promotion(100_000, 1.0)
    assert costs.rates()[D] < 2e9
    # a measured fast disk makes the G3 tail worth loading
    for _ in range(20):
        costs.observe_promotion(20e9, 1.0)
    assert costs.decide([D] * 4, 2 << 20, 16, 33_000).reason is OnboardReason.LOAD
