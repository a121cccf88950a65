"""The simulated engine backend: a latency model fitted to the real engine, an executor that
sleeps for it, and a tiny tokenizer. Never imports torch."""

from __future__ import annotations

from strata.sim.executor import SimulatedExecutor, StepShape, step_shape
from strata.sim.profile import (
    LatencyProfile,
    ProfilePoint,
    bundled_profiles,
    fit_error,
    fit_profile,
    load_profile,
)

__all__ = [
    "LatencyProfile",
    "ProfilePoint",
    "SimulatedExecutor",
    "StepShape",
    "bundled_profiles",
    "fit_error",
    "fit_profile",
    "load_profile",
    "step_shape",
]
