"""A latency profile with round numbers, so that the expected times can be worked out by hand:
a prefill step of P tokens costs 10 + 0.5 P ms, a decode step of D sequences 20 + D ms."""

from __future__ import annotations

import pytest

from strata.sim.profile import LatencyProfile


@pytest.fixture
def round_profile() -> LatencyProfile:
    return LatencyProfile(model="round", source="synthetic", prefill_ms_base=10.0,
                          prefill_ms_per_token=0.5, decode_ms_base=20.0, decode_ms_per_seq=1.0)
