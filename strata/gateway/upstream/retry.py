"""The retry budget: retries may not exceed `budget_ratio` of recent requests plus
`budget_min_per_s` per second, over a sliding `budget_window_s` (so a failing fleet is not hit by a
retry storm on top of its normal traffic)."""

from __future__ import annotations

import time
from collections import deque

from strata.clock import Clock
from strata.gateway.config import RetryConfig


class RetryBudget:
    """Sliding-window counts of requests and retries; `try_spend()` takes one retry if allowed."""

    def __init__(self, config: RetryConfig, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def record_request(self) -> None:
        now = self.clock()
        self._expire(now)  # here too: a fleet that never fails never calls try_spend
        self._requests.append(now)

    def try_spend(self) -> bool:
        """True (and counted) when one more retry fits the budget."""
        now = self.clock()
        self._expire(now)
        allowed = (self.config.budget_ratio * len(self._requests)
                   + self.config.budget_min_per_s * self.config.budget_window_s)
        if len(self._retries) + 1 > allowed:
            return False
        self._retries.append(now)
        return True

    def backoff_s(self, attempt: int) -> float:
        """Sleep before retry number `attempt` (0-based)."""
        return min(self.config.backoff_base_s * 2.0**attempt, self.config.backoff_max_s)

    def _expire(self, now: float) -> None:
        horizon = now - self.config.budget_window_s
        for window in (self._requests, self._retries):
            while window and window[0] <= horizon:
                window.popleft()


__all__ = ["RetryBudget"]
