"""What a release is judged by: its timeouts and lease, and a canary's health thresholds.

    ReleaseConfig    timeouts, lease, canary thresholds, consistency level (validated once)
    VersionHealth    recent requests, errors and TTFT p99 of one version (the gateways measure it)
    judge_canary     "" while a canary is healthy, else why it must roll back
    Warm, HealthOf   the callables a ReleaseController is given
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.registry.instances.records import InstanceRecord


@dataclass(frozen=True, slots=True)
class ReleaseConfig:
    ready_timeout_s: float = 600.0  # new instances READY and warmed by then, else roll back
    retire_timeout_s: float = 120.0  # old instances gone by then, else DONE with a note
    poll_s: float = 0.2
    lease_s: float = 10.0  # a controller that stops renewing loses the release
    canary_window_s: float = 30.0  # canary watched this long before promotion
    canary_min_requests: int = 20  # fewer canary requests than this prove nothing
    canary_max_error_rate: float = 0.05
    canary_max_ttft_p99_ratio: float = 2.0  # canary TTFT p99 / live TTFT p99
    propagation_s: float = 1.0  # after a flip, before the old version is retired
    keep_releases: int = 20  # finished releases kept per model (older ones are deleted)
    # strict: the flip is done only once every gateway's routing view (registry/models/views.py)
    # acknowledged it or the gateway fenced itself (its view silent longer than its lease);
    # bounded: every gateway moves within its poll, unproven (registry/releases/flip_acks.py)
    consistency: str = "bounded"

    def __post_init__(self) -> None:
        for name in ("ready_timeout_s", "retire_timeout_s", "poll_s", "lease_s",
                     "canary_window_s", "canary_max_ttft_p99_ratio"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"release {name} must be > 0, got {getattr(self, name)}")
        if self.propagation_s < 0:
            raise ConfigError(f"release propagation_s must be >= 0, got {self.propagation_s}")
        if self.lease_s < 2 * self.poll_s:
            raise ConfigError(f"release lease_s ({self.lease_s}) must be at least 2 x poll_s "
                              f"({self.poll_s}) so that the lease is renewed before it lapses")
        if self.consistency not in ("strict", "bounded"):
            raise ConfigError("release consistency must be strict or bounded, "
                              f"got {self.consistency!r}")
        if self.keep_releases < 1:
            raise ConfigError(f"release keep_releases must be >= 1, got {self.keep_releases}")
        if self.canary_min_requests < 1:
            raise ConfigError("release canary_min_requests must be >= 1, "
                              f"got {self.canary_min_requests}")
        if not 0.0 <= self.canary_max_error_rate <= 1.0:
            raise ConfigError("release canary_max_error_rate must be in [0, 1], "
                              f"got {self.canary_max_error_rate}")


@dataclass(frozen=True, slots=True)
class VersionHealth:
    num_requests: int
    num_errors: int
    ttft_p99_ms: float | None  # None: no successful request measured


Warm = Callable[[InstanceRecord], Awaitable[None]]  # one real request; raises on failure
HealthOf = Callable[[str, str], Awaitable[VersionHealth]]  # (name, version) -> recent health


def judge_canary(name: str, version: str, canary: VersionHealth, live: VersionHealth,
                 config: ReleaseConfig) -> str:
    """Why canary `version` must roll back ("" while healthy or not yet judged)."""
    if canary.num_requests < config.canary_min_requests:
        return ""
    error_rate = canary.num_errors / canary.num_requests
    if error_rate > config.canary_max_error_rate:
        return (f"canary {name}@{version}: error rate {error_rate:.1%} ({canary.num_errors} of "
                f"{canary.num_requests} requests) above canary_max_error_rate "
                f"{config.canary_max_error_rate:.1%}")
    if canary.ttft_p99_ms is None or not live.ttft_p99_ms:
        return ""
    ratio = canary.ttft_p99_ms / live.ttft_p99_ms
    if ratio > config.canary_max_ttft_p99_ratio:
        return (f"canary {name}@{version}: TTFT p99 {canary.ttft_p99_ms:.0f} ms is {ratio:.1f}x "
                f"the live version's {live.ttft_p99_ms:.0f} ms, above "
                f"canary_max_ttft_p99_ratio {config.canary_max_ttft_p99_ratio}")
    return ""


__all__ = ["HealthOf", "ReleaseConfig", "VersionHealth", "Warm", "judge_canary"]
