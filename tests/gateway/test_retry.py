"""The retry budget: a ratio of recent requests plus a floor per second, over a sliding window."""

from __future__ import annotations

from gateway_fakes import FakeClock

from strata.gateway.config import RetryConfig
from strata.gateway.upstream.retry import RetryBudget

CONFIG = RetryConfig(backoff_base_s=0.02, backoff_max_s=0.05, budget_ratio=0.5,
                     budget_min_per_s=0.1, budget_window_s=10.0)


def test_retries_are_bounded_by_the_ratio_plus_the_floor() -> None:
    clock = FakeClock()
    budget = RetryBudget(CONFIG, clock)
    for _ in range(4):
        budget.record_request()
    # 0.5 * 4 requests + 0.1/s * 10 s = 3 retries
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]


def test_the_window_slides() -> None:
    clock = FakeClock()
    budget = RetryBudget(CONFIG, clock)
    for _ in range(4):
        budget.record_request()
    assert all(budget.try_spend() for _ in range(3))
    clock.advance(10.0)  # requests and retries left the window: only the floor remains
    assert [budget.try_spend() for _ in range(2)] == [True, False]


def test_requests_without_retries_do_not_accumulate() -> None:
    clock = FakeClock()
    budget = RetryBudget(CONFIG, clock)
    for _ in range(1000):
        budget.record_request()
        clock.advance(0.25)
    assert len(budget._requests) == 40  # only the last window's worth is kept


def test_backoff_doubles_up_to_its_cap() -> None:
    budget = RetryBudget(CONFIG, FakeClock())
    assert [budget.backoff_s(n) for n in range(4)] == [0.02, 0.04, 0.05, 0.05]
