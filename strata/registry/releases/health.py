"""A canary's health pooled over every gateway, through the model registry.

Each gateway measures the requests it proxies, per name@version, over its own sliding window
(gateway/versions.py `VersionStats`); while a model has a canary, it publishes that window of the
canary and of the live version to the registry every second or so. The release controller judges
the canary on the sum of every gateway's recent window, so a canary that fails only the traffic
of gateways that do not drive the release is rolled back all the same.

    HealthWindow     one gateway's window of name@version: requests, errors, a TTFT histogram
    ttft_bucket      the histogram's buckets: fixed and about 9 % wide, so windows add exactly
    pooled           -> VersionHealth of the sum of windows (TTFT p99: its bucket's upper bound)
    HealthBoard      where windows are published (every ModelRegistry is one)

A histogram rather than samples: a window's size does not grow with its traffic, and windows of
any number of gateways add up to the histogram of all their requests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from strata.registry.releases.policy import VersionHealth

BUCKETS_PER_DOUBLING = 8  # bucket bounds 2 ** (1/8) = 1.09 apart
_BUCKET_0_MS = 0.1  # bucket 0 holds every TTFT up to 0.1 ms
HEALTH_RETENTION_S = 300.0  # a window not republished for this long is dropped on the next write


def ttft_bucket(ttft_ms: float) -> int:
    """The histogram bucket of `ttft_ms`: the smallest b with ttft_ms <= bucket_upper_ms(b)."""
    if ttft_ms <= _BUCKET_0_MS:
        return 0
    return math.ceil(math.log2(ttft_ms / _BUCKET_0_MS) * BUCKETS_PER_DOUBLING - 1e-9)


def bucket_upper_ms(bucket: int) -> float:
    return float(_BUCKET_0_MS * 2 ** (bucket / BUCKETS_PER_DOUBLING))


@dataclass(frozen=True, slots=True)
class HealthWindow:
    """One gateway's recent outcomes of name@version, as it published them. `ttft_counts`:
    (bucket, successful requests whose TTFT fell in it), by bucket."""

    gateway: str
    name: str
    version: str
    num_requests: int = 0
    num_errors: int = 0
    ttft_counts: tuple[tuple[int, int], ...] = ()
    published_at: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    def to_json(self) -> dict[str, Any]:
        return {"gateway": self.gateway, "name": self.name, "version": self.version,
                "num_requests": self.num_requests, "num_errors": self.num_errors,
                "ttft_counts": [list(c) for c in self.ttft_counts],
                "published_at": self.published_at}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HealthWindow:
        return cls(gateway=str(data["gateway"]), name=str(data["name"]),
                   version=str(data["version"]), num_requests=int(data["num_requests"]),
                   num_errors=int(data["num_errors"]),
                   ttft_counts=tuple((int(b), int(n)) for b, n in data["ttft_counts"]),
                   published_at=float(data.get("published_at", 0.0)))


def window_of(gateway: str, name: str, version: str,
              outcomes: Iterable[tuple[bool, float | None]]) -> HealthWindow:
    """The window of (is_error, TTFT in ms or None) outcomes."""
    num_requests = num_errors = 0
    counts: Counter[int] = Counter()
    for is_error, ttft_ms in outcomes:
        num_requests += 1
        num_errors += is_error
        if ttft_ms is not None:
            counts[ttft_bucket(ttft_ms)] += 1
    return HealthWindow(gateway, name, version, num_requests, num_errors,
                        tuple(sorted(counts.items())))


def pooled(windows: Iterable[HealthWindow]) -> VersionHealth:
    """The health of every request of `windows` together."""
    num_requests = num_errors = 0
    counts: Counter[int] = Counter()
    for window in windows:
        num_requests += window.num_requests
        num_errors += window.num_errors
        counts.update(dict(window.ttft_counts))
    return VersionHealth(num_requests, num_errors, _p99_ms(counts))


def _p99_ms(counts: Counter[int]) -> float | None:
    """The upper bound of the bucket of the p99 TTFT (the sample at index int(0.99 n) of n
    sorted samples, as the controller has always taken it)."""
    total = sum(counts.values())
    if not total:
        return None
    rank = min(total, int(0.99 * total) + 1)
    seen = 0
    for bucket in sorted(counts):
        seen += counts[bucket]
        if seen >= rank:
            return bucket_upper_ms(bucket)
    raise AssertionError("unreachable: the ranks add up to total")


@runtime_checkable
class HealthBoard(Protocol):
    """Where gateways publish their windows (every ModelRegistry backend).

    Contract (tests/registry/test_models_contract.py):
    - `put_health` stores `window` stamped `published_at = clock()`, replacing the previous
      window of the same gateway and name@version; it returns the window as stored. Windows
      not republished for HEALTH_RETENTION_S are dropped (on a later write, or expired).
    - `list_health` returns the windows of name@version published in the last
      HEALTH_RETENTION_S, sorted by gateway.
    """

    async def put_health(self, window: HealthWindow) -> HealthWindow: ...

    async def list_health(self, name: str, version: str) -> list[HealthWindow]: ...


__all__ = ["BUCKETS_PER_DOUBLING", "HEALTH_RETENTION_S", "HealthBoard", "HealthWindow",
           "bucket_upper_ms", "pooled", "ttft_bucket", "window_of"]
