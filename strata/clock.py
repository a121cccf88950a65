"""Time as an injected value.

Every component that reads time takes a `Clock`: a function returning seconds (`time.monotonic`,
`time.time`, `time.perf_counter`, or a `ManualClock`). A `ManualClock` moves only when told to:
it is the fake clock of the tests and the virtual clock of a simulation (the capacity planner and
the autoscaler run the real scheduler and policies on one), so a story over minutes of traffic
runs in milliseconds and gives the same answer every time.
"""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]


class ManualClock:
    """A clock that reads `now` and moves forward only by `advance` (or by setting `now`)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move forward by `seconds` (never back); returns the new time."""
        if seconds < 0:
            raise ValueError(f"a clock never moves back; advance({seconds}) asked it to")
        self.now += seconds
        return self.now

    def set(self, now: float) -> float:
        """Move forward to `now` (never back); returns it."""
        return self.advance(now - self.now)

    def __repr__(self) -> str:
        return f"ManualClock(now={self.now})"


__all__ = ["Clock", "ManualClock"]
