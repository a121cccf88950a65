"""Stopping a simulation once its SLO is surely missed.

An overloaded configuration is the slowest to simulate (its queue grows to the end) and the
least interesting: once more requests are over a bound than its percentile allows, that
percentile is over the bound whatever the rest do. The search stops such a run there; its
figures then cover the requests done so far, and the row says so.
"""

from __future__ import annotations

import math

from strata.plan.workload import Slo


class SloWatch:
    def __init__(self, slo: Slo, num_requests: int) -> None:
        self.slo = slo
        self.max_late_ttft = self._allowed(num_requests, slo.ttft_percentile)
        self.max_late_tpot = self._allowed(num_requests, slo.tpot_percentile)
        self.num_late_ttft = 0
        self.num_late_tpot = 0

    @staticmethod
    def _allowed(n: int, percentile: float) -> int:
        """Values over the bound the p-th percentile (linear interpolation) may have: with
        more, its rank (n - 1) p / 100 falls among them."""
        return math.ceil((n - 1) * (1 - percentile / 100)) + 1

    def first_token(self, ttft_s: float) -> None:
        if ttft_s * 1000 > self.slo.ttft_ms:
            self.num_late_ttft += 1

    def finished(self, tpot_s: float | None) -> None:
        if tpot_s is not None and tpot_s * 1000 > self.slo.tpot_ms:
            self.num_late_tpot += 1

    @property
    def is_hopeless(self) -> bool:
        return (self.num_late_ttft > self.max_late_ttft
                or self.num_late_tpot > self.max_late_tpot)


__all__ = ["SloWatch"]
