"""The manual clock: it reads what it was set to and moves only forward, when told."""

from __future__ import annotations

import pytest

from strata.clock import Clock, ManualClock


def test_a_manual_clock_moves_only_when_told_and_only_forward() -> None:
    clock = ManualClock(1000.0)
    reader: Clock = clock  # it is a Clock wherever one is injected
    assert (reader(), reader()) == (1000.0, 1000.0)
    assert clock.advance(2.5) == 1002.5 and reader() == 1002.5
    with pytest.raises(ValueError, match="never moves back"):
        clock.advance(-1.0)
    assert reader() == 1002.5
    assert ManualClock()() == 0.0
