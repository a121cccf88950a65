"""How many instances each LoRA adapter is placed on: k from its demand, with hysteresis.

An adapter's demand is its share of the gateway's requests over the last `window_s`: both counts
decay exponentially with that time constant (`DecayingCount`), so the share needs no list of
timestamps and an adapter that stops being asked for fades out of the window. The share is
taken of at least `min_requests` requests, so that the first requests after a start (when one
adapter is all the traffic seen) do not spread it over the fleet.

    level   the share k is sized for: k = clamp(ceil(spread * level * n), 1, n) over the n
            instances serving the adapter (`replicas`), so k follows the fleet as it grows
    grow    a share above the level raises the level at once (demand is served now)
    shrink  a share under level / (1 + hysteresis) starts a countdown; after `shrink_after_s`
            of it, the level falls to the share; a share back over the band stops the countdown

The band and the countdown keep k from flapping around a boundary (each change of k moves
requests to instances that must load the adapter). Only `observe` changes state (the policy's
routed hook); `replicas` is a pure read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from strata.clock import Clock
from strata.gateway.config import AdapterPlacementConfig


@dataclass(slots=True)
class DecayingCount:
    """Events of about the last `window_s`: each adds one, the sum decays by e per window."""

    value: float = 0.0
    at: float = 0.0

    def read(self, now: float, window_s: float) -> float:
        return self.value * math.exp(-max(0.0, now - self.at) / window_s)

    def add(self, now: float, window_s: float) -> float:
        self.value, self.at = self.read(now, window_s) + 1.0, now
        return self.value


@dataclass(slots=True)
class AdapterDemand:
    """One adapter's requests and the level its k is sized for."""

    count: DecayingCount
    level: float = 0.0
    below_since: float | None = None  # when the share fell under the band (None: it is not)


class DemandTable:
    """Every adapter's demand and k (see the module docstring)."""

    def __init__(self, config: AdapterPlacementConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.total = DecayingCount()
        self._adapters: dict[str, AdapterDemand] = {}

    def observe(self, adapter: str) -> None:
        """A request for `adapter` was routed: its share and level move."""
        now, window_s = self.clock(), self.config.window_s
        total = self.total.add(now, window_s)
        demand = self._adapters.get(adapter)
        if demand is None:
            demand = self._adapters[adapter] = AdapterDemand(DecayingCount())
        share = demand.count.add(now, window_s) / max(total, self.config.min_requests)
        self._move_level(demand, share, now)

    def _move_level(self, demand: AdapterDemand, share: float, now: float) -> None:
        if share >= demand.level:
            demand.level, demand.below_since = share, None
        elif share * (1.0 + self.config.hysteresis) >= demand.level:
            demand.below_since = None
        elif demand.below_since is None:
            demand.below_since = now
        elif now - demand.below_since >= self.config.shrink_after_s:
            demand.level, demand.below_since = share, None

    def share(self, adapter: str) -> float:
        """The adapter's share of the requests of the window now."""
        demand = self._adapters.get(adapter)
        if demand is None:
            return 0.0
        now, window_s = self.clock(), self.config.window_s
        total = max(self.total.read(now, window_s), self.config.min_requests)
        return demand.count.read(now, window_s) / total

    def replicas(self, adapter: str, num_instances: int) -> int:
        """k: how many of `num_instances` the adapter is placed on (at least one)."""
        demand = self._adapters.get(adapter)
        level = demand.level if demand is not None else 0.0
        wanted = math.ceil(self.config.spread * level * num_instances - 1e-9)
        return max(1, min(num_instances, wanted))


__all__ = ["AdapterDemand", "DecayingCount", "DemandTable"]
