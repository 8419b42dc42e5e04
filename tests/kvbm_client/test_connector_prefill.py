"""The scheduler side's prefill meter (step times) and what a lookup sends to the leader."""
from types import SimpleNamespace

import pytest

from kvbm_client.connectors.core import ConnectorSettings, SchedulerCore
from kvbm_client.connectors.core.prefill import MIN_PREFILL_TOKENS, PrefillMeter
from kvbm_client.handles import TransferHandle
from kvbm_client.hashing import RequestExtras
from kvbm_client.ids import PlanKind


def test_prior_until_a_prefill_step_was_measured() -> None:
    meter = PrefillMeter(prior=30_000)
    assert meter.tokens_per_s == 30_000
    meter.scheduled(MIN_PREFILL_TOKENS - 1, now=0.0)  # a decode step: not a sample
    meter.finished(now=1.0)
    assert meter.tokens_per_s == 30_000


def test_step_time_excludes_queueing_behind_the_previous_step_and_idle_time() -> None:
    meter = PrefillMeter()
    assert meter.tokens_per_s == 0.0  # no prior: unknown
    meter.scheduled(1000, now=0.0)
    meter.scheduled(2000, now=0.1)   # asynchronous scheduling: queued behind the first
    meter.finished(now=1.0)          # first: 1000 tokens in 1 s
    meter.finished(now=2.0)          # second ran from 1.0, not 0.1: 2000 tokens in 1 s
    assert meter.tokens_per_s == pytest.approx(1000 * 2 ** 0.5)  # geometric mean of 1000 and 2000
    meter.scheduled(1000, now=100.0)  # after an idle minute
    meter.finished(now=100.5)
    assert meter.tokens_per_s > 1000


def test_a_finish_without_an_open_step_is_ignored() -> None:
    meter = PrefillMeter(prior=5.0)
    meter.finished(now=1.0)
    assert meter.tokens_per_s == 5.0


class Leader:
    def __init__(self) -> None:
        self.rates: list[float] = []

    def prepare_load(self, hashes, count_hit=False, tokens_per_block=0, prefill_tokens_per_s=0.0, stage=None):
        self.rates.append(prefill_tokens_per_s)
        return TransferHandle(PlanKind.LOAD, None, 0, skipped_cost=len(hashes))

    def prepare_store(self, hashes):
        return None

    def may_hold(self, key):
        return True  # (no presence filter: every lookup asks)

    def unasked(self, blocks):
        pass

    def release(self, handle) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("cost_aware,sent", [(True, 12_000.0), (False, 0.0)])
def test_lookup_sends_the_estimate_only_when_cost_aware(cost_aware: bool, sent: float) -> None:
    settings = ConnectorSettings("unix:/x", "unix:/w{id}", "ns", 1.0, 1.0, cost_aware_loads=cost_aware,
                                 prefill_tokens_per_s=12_000.0)
    leader = Leader()
    core = SchedulerCore(4, settings, leader, lambda r: RequestExtras())
    request = SimpleNamespace(request_id="r", all_token_ids=list(range(40)))
    assert core.lookup(request, 0) == (0, False)
    assert leader.rates == [sent]


def test_vllm_settings_read_the_switch_and_the_prior(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_KVBM_COST_AWARE_LOADS", "false")
    monkeypatch.setenv("DYN_KVBM_PREFILL_TOKENS_PER_S", "5000")
    s = ConnectorSettings.from_extra({}, "ns")
    assert (s.cost_aware_loads, s.prefill_tokens_per_s) == (False, 5000.0)
    s = ConnectorSettings.from_extra({"cost_aware_loads": True, "prefill_tokens_per_s": 7}, "ns")
    assert (s.cost_aware_loads, s.prefill_tokens_per_s) == (True, 7.0)
    with pytest.raises(ValueError, match="cost_aware_loads"):
        ConnectorSettings.from_extra({"cost_aware_loads": "maybe"}, "ns")
