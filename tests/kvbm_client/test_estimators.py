"""RateEstimator: the prior until measured, warm-up averaging, clipped EWMA, ignored garbage."""
import math

import pytest

from kvbm_client.estimators import RateEstimator


def test_prior_until_measured() -> None:
    est = RateEstimator(2e9)
    assert est.rate == pytest.approx(2e9) and not est.measured
    assert est.seconds_for(4e9) == pytest.approx(2.0)


def test_no_prior_is_unknown_until_the_first_sample() -> None:
    est = RateEstimator(0.0)
    assert est.rate == 0.0 and est.seconds_for(1.0) == math.inf
    assert est.observe(1000, 0.5)
    assert est.rate == pytest.approx(2000)


def test_warmup_forgets_a_wrong_prior_geometrically() -> None:
    est = RateEstimator(1.0, warmup=3)
    est.observe(100, 1.0)  # the prior counts as one sample: geometric mean of 1 and 100
    assert est.rate == pytest.approx(10.0)
    est.observe(100, 1.0)
    est.observe(100, 1.0)
    assert est.rate == pytest.approx(100 ** 0.75)  # (0 + 3 * log 100) / 4


def test_after_warmup_one_outlier_moves_it_at_most_clip_to_the_alpha() -> None:
    est = RateEstimator(1e9, alpha=0.2, clip=4.0, warmup=0)
    est.observe(1e9, 1e-6)  # a page-cache hit: 1000x faster
    assert est.rate == pytest.approx(1e9 * 4 ** 0.2)
    est = RateEstimator(1e9, alpha=0.2, clip=4.0, warmup=0)
    est.observe(1e9, 1e3)  # a stalled disk: 1000x slower
    assert est.rate == pytest.approx(1e9 / 4 ** 0.2)


def test_converges_to_a_steady_rate() -> None:
    est = RateEstimator(20e9)
    for _ in range(60):
        est.observe(2e9, 1.0)
    assert est.rate == pytest.approx(2e9, rel=1e-3)


@pytest.mark.parametrize("amount,seconds", [(0, 1.0), (1, 0.0), (-5, 1.0), (1, -1.0), (math.nan, 1.0),
                                            (1, math.inf)])
def test_garbage_samples_change_nothing(amount: float, seconds: float) -> None:
    est = RateEstimator(5.0)
    assert not est.observe(amount, seconds)
    assert est.rate == pytest.approx(5.0) and est.samples == 0
