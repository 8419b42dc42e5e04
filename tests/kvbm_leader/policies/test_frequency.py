"""FrequencyFilter: Dynamo's disk offload filter (1 on first sight, x2 per hit, -1 per decay)."""
from __future__ import annotations

import pytest

from kvbm_client.ids import BlockHash
from kvbm_leader.policies.frequency import OFFLOAD_THRESHOLD, FrequencyFilter


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(8, "big"))


def make_filter(max_entries: int = 1000, enabled: bool = True) -> FrequencyFilter:
    return FrequencyFilter(max_entries=max_entries, enabled=enabled)


def test_threshold_is_two() -> None:
    assert OFFLOAD_THRESHOLD == 2


def test_unknown_block_has_frequency_zero_and_does_not_pass() -> None:
    f = make_filter()
    assert f.frequency(key(1)) == 0
    assert not f.passes(key(1))
    assert len(f) == 0


def test_observe_starts_at_one_and_does_not_grow() -> None:
    f = make_filter()
    assert f.observe(key(1)) == 1
    assert f.observe(key(1)) == 1
    assert f.frequency(key(1)) == 1
    assert not f.passes(key(1))


def test_observe_keeps_a_higher_frequency() -> None:
    f = make_filter()
    f.observe(key(1))
    f.hit(key(1))
    assert f.observe(key(1)) == 2


@pytest.mark.parametrize("hits, expected", [(0, 1), (1, 2), (2, 4), (3, 8), (5, 32)])
def test_each_hit_doubles(hits: int, expected: int) -> None:
    f = make_filter()
    f.observe(key(1))
    for _ in range(hits):
        f.hit(key(1))
    assert f.frequency(key(1)) == expected
    assert f.passes(key(1)) == (expected >= 2)


def test_hit_on_unknown_block_counts_as_seen_then_hit() -> None:
    f = make_filter()
    assert f.hit(key(7)) == 2
    assert f.passes(key(7))


def test_decay_lowers_every_frequency_by_one() -> None:
    f = make_filter()
    f.observe(key(1))
    f.hit(key(1))
    f.hit(key(1))  # 4
    f.hit(key(2))  # 2

    f.decay()
    assert (f.frequency(key(1)), f.frequency(key(2))) == (3, 1)
    assert f.passes(key(1)) and not f.passes(key(2))

    f.decay()
    assert (f.frequency(key(1)), f.frequency(key(2))) == (2, 0)


def test_hit_after_decay_doubles_the_decayed_value() -> None:
    f = make_filter()
    f.hit(key(1))
    f.hit(key(1))  # 4
    f.decay()  # 3
    assert f.hit(key(1)) == 6


def test_entry_is_forgotten_at_zero() -> None:
    f = make_filter()
    f.observe(key(1))
    assert len(f) == 1

    f.decay()

    assert f.frequency(key(1)) == 0
    assert len(f) == 0
    assert f.observe(key(1)) == 1  # seen afresh, not resurrected at a stale count


def test_frequency_never_goes_negative() -> None:
    f = make_filter()
    f.observe(key(1))
    for _ in range(5):
        f.decay()
    assert f.frequency(key(1)) == 0


def test_decay_prune_budget_bounds_the_work() -> None:
    f = make_filter()
    for i in range(5):
        f.observe(key(i))

    f.decay(prune_budget=2)

    assert len(f) == 3  # two pruned now, the rest later
    assert all(f.frequency(key(i)) == 0 for i in range(5))


def test_decay_forgets_every_zeroed_entry_within_budget() -> None:
    f = make_filter()
    f.hit(key(1))  # 2, written first
    f.observe(key(2))  # 1, written later

    f.decay()

    assert f.frequency(key(2)) == 0
    assert len(f) == 1


def test_bound_drops_forgotten_entries_before_live_ones() -> None:
    f = make_filter(max_entries=2)
    f.hit(key(1))
    f.hit(key(1))  # 4
    f.observe(key(2))  # 1
    f.decay()  # key 1 -> 3, key 2 -> 0 (forgotten)

    f.observe(key(3))

    assert f.frequency(key(1)) == 3


def test_bound_drops_least_recently_touched() -> None:
    f = make_filter(max_entries=3)
    for i in (1, 2, 3):
        f.hit(key(i))
    f.hit(key(1))  # touch 1: now 2 is least recently touched

    f.observe(key(4))

    assert len(f) == 3
    assert f.frequency(key(2)) == 0
    assert [f.frequency(key(i)) for i in (1, 3, 4)] == [4, 2, 1]


def test_reading_a_frequency_is_not_a_touch() -> None:
    f = make_filter(max_entries=2)
    f.hit(key(1))
    f.hit(key(2))
    assert f.frequency(key(1)) == 2
    assert f.passes(key(1))

    f.hit(key(3))

    assert f.frequency(key(1)) == 0
    assert f.frequency(key(2)) == 2


@pytest.mark.parametrize("enabled", [True, False])
def test_disabled_filter_passes_everything(enabled: bool) -> None:
    f = make_filter(enabled=enabled)
    f.observe(key(1))
    assert f.passes(key(1)) is (not enabled)
    assert f.passes(key(99)) is (not enabled)  # never seen


@pytest.mark.parametrize("max_entries", [0, -1])
def test_max_entries_must_be_positive(max_entries: int) -> None:
    with pytest.raises(ValueError):
        FrequencyFilter(max_entries=max_entries)


def test_hit_many_is_hit_for_each_key() -> None:
    one, many = make_filter(max_entries=4), make_filter(max_entries=4)
    for f in (one, many):
        f.observe(key(1))
        f.hit(key(2))
        f.decay()
    keys = [key(1), key(2), key(3), key(4), key(5), key(1)]
    for k in keys:
        one.hit(k)
    many.hit_many(keys)
    assert [one.frequency(key(i)) for i in range(6)] == [many.frequency(key(i)) for i in range(6)]
    assert len(one) == len(many) == 4  # the bound evicted the same least recent entry
    assert one.frequency(key(2)) == many.frequency(key(2)) == 0


def _offer_as_before(f: FrequencyFilter, k: BlockHash) -> None:
    """What ``PrepareStore`` did per key before :meth:`FrequencyFilter.offer` (the reference)."""
    if f.frequency(k) > 0:
        f.hit(k)
    else:
        f.observe(k)


def test_offer_starts_at_one_then_doubles() -> None:
    f = make_filter()
    f.offer(key(1))
    assert f.frequency(key(1)) == 1 and not f.passes(key(1))
    f.offer(key(1))
    assert f.frequency(key(1)) == 2 and f.passes(key(1))
    f.decay()
    f.decay()
    f.offer(key(1))  # decayed to 0: a first sight again
    assert f.frequency(key(1)) == 1


@pytest.mark.parametrize("seed", range(20))
def test_offer_is_observe_or_hit_as_before(seed: int) -> None:
    """Random offers, hits and decays on a small bound: the fused ``offer`` leaves the same
    frequencies, the same entries and the same recency order as the old composition."""
    import random

    rng = random.Random(seed)
    new, old = make_filter(max_entries=8), make_filter(max_entries=8)
    for _ in range(400):
        op, k = rng.random(), key(rng.randrange(16))
        if op < 0.6:
            new.offer(k)
            _offer_as_before(old, k)
        elif op < 0.85:
            new.hit(k)
            old.hit(k)
        else:
            budget = rng.randrange(4)
            new.decay(prune_budget=budget)
            old.decay(prune_budget=budget)
        assert [new.frequency(key(i)) for i in range(16)] == [old.frequency(key(i)) for i in range(16)]
        assert list(new._table) == list(old._table)  # same entries, same recency order (the bound's victims)
