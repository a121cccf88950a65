"""What a gateway measures of its own traffic, typed and windowed: the autoscaler's reading.

    num_requests         generation requests that entered the path
    num_remote_prefills  of those, the ones the P/D step handed to a prefill instance
    first_bytes          (when, seconds from send to the first byte, pool) of each answered
                         attempt: the time to first token as the gateway sees it
    gaps                 (when, seconds between two chunks, pool) of every relayed stream: the
                         inter-token latency as the client sees it, measured from the bytes
                         the gateway relays (a timestamp per chunk, nothing parsed)

The proxy and the P/D step write here as part of their work; readers (the autoscaler's signal
reader, strata/autoscale/gateway_link.py) read the fields and `since`, never /metrics samples.
Samples older than `keep_s` are dropped as new ones arrive, and at most `max_samples` are kept
of each kind, so the memory is bounded whatever the traffic.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from strata.clock import Clock


@dataclass(frozen=True, slots=True)
class Sample:
    at_s: float
    value_s: float
    pool: str


class GatewayStats:
    """Counters and recent samples of one gateway (see the module docstring)."""

    def __init__(self, clock: Clock = time.monotonic, *, keep_s: float = 120.0,
                 max_samples: int = 100_000) -> None:
        self.clock = clock
        self.keep_s = keep_s
        self.num_requests = 0
        self.num_remote_prefills = 0
        self.first_bytes: deque[Sample] = deque(maxlen=max_samples)
        self.gaps: deque[Sample] = deque(maxlen=max_samples)

    def request_entered(self) -> None:
        self.num_requests += 1

    def remote_prefill(self) -> None:
        self.num_remote_prefills += 1

    def first_byte(self, pool: str, seconds: float) -> None:
        self._add(self.first_bytes, pool, seconds)

    def gap(self, pool: str, seconds: float) -> None:
        self._add(self.gaps, pool, seconds)

    def _add(self, samples: deque[Sample], pool: str, seconds: float) -> None:
        now = self.clock()
        samples.append(Sample(now, seconds, pool))
        while samples[0].at_s < now - self.keep_s:
            samples.popleft()

    def since(self, samples: Iterable[Sample], start_s: float,
              pools: Iterable[str] | None = None) -> list[float]:
        """The values of `samples` taken at `start_s` or later (of `pools`; None: any), sorted."""
        wanted = None if pools is None else set(pools)
        return sorted(s.value_s for s in samples
                      if s.at_s >= start_s and (wanted is None or s.pool in wanted))


def p95(values: list[float]) -> float | None:
    """The 95th percentile of sorted `values` (None when empty)."""
    return values[int(0.95 * (len(values) - 1))] if values else None


__all__ = ["GatewayStats", "Sample", "p95"]
