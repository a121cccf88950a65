"""Clocks: what the parts that measure or wait on time are given, so tests control time.

    Clock         a callable returning seconds (time.monotonic, time.time, a ManualClock)
    ManualClock   a clock that moves only when told: tests and virtual-time simulations
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass(slots=True)
class ManualClock:
    """Reads `now`; `advance` and `set` move it, never backwards."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"a clock never goes back; advance by {seconds}")
        self.now += seconds
        return self.now

    def set(self, now: float) -> float:
        return self.advance(now - self.now)


__all__ = ["Clock", "ManualClock"]
