"""Each instance's requests in flight averaged over the last request duration: the load that a
"max/mean load" target bounds, which the instantaneous count only approximates.

A placement's load lasts as long as its request, so the window is the mean request duration
this gateway has measured (routed to finished, on the injected clock), not a setting: the
average is an exponential moving one with that time constant over this gateway's requests in
flight at each instance, advanced by the hooks (a route, a finish) and read as of now, without
a change, by `choose` (`under_bound`). Until a request has finished there is no duration
and no average, and `under_bound` is empty.

Pure bookkeeping over an injected clock, no I/O, like the prefix index beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from strata.clock import Clock
from strata.gateway.routing.instances import InstanceView

FORGOTTEN = 1e-6  # an average below this many requests, with none in flight, is dropped (0)


class LoadAverages:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._average: dict[str, float] = {}
        self._load: dict[str, int] = {}  # requests in flight since the last event
        self._last_s: float | None = None
        self._started_s: dict[tuple[int, str], float] = {}  # (id of the route, instance)
        self._duration_sum_s = 0.0
        self._num_durations = 0

    @property
    def window_s(self) -> float | None:
        """The mean request duration measured so far (None before the first finish)."""
        return self._duration_sum_s / self._num_durations if self._num_durations else None

    def average(self, instance_id: str) -> float:
        """The instance's average as of now (the load held since the last event included)."""
        average = self._average.get(instance_id, 0.0)
        return average + (self._load.get(instance_id, 0) - average) * self._weight(self.clock())

    def under_bound(self, candidates: Sequence[InstanceView], epsilon: float) -> set[str]:
        """The candidates whose average is under (1 + epsilon) times the candidates' mean."""
        if self.window_s is None:
            return set()
        averages = {view.instance_id: self.average(view.instance_id) for view in candidates}
        bound = (1.0 + epsilon) * sum(averages.values()) / len(averages)
        return {iid for iid, average in averages.items() if average < bound}

    def routed(self, route_id: int, instance_id: str) -> None:
        self._advance()
        self._load[instance_id] = self._load.get(instance_id, 0) + 1
        self._started_s[(route_id, instance_id)] = self.clock()

    def finished(self, route_id: int, instance_id: str) -> None:
        self._advance()
        left = self._load.get(instance_id, 0) - 1
        if left > 0:
            self._load[instance_id] = left
        else:
            self._load.pop(instance_id, None)
        started = self._started_s.pop((route_id, instance_id), None)
        if started is not None:
            self._duration_sum_s += self.clock() - started
            self._num_durations += 1

    def _advance(self) -> None:
        now = self.clock()
        weight = self._weight(now)
        for iid in self._load.keys() | self._average.keys():
            load, old = self._load.get(iid, 0), self._average.get(iid, 0.0)
            average = old + (load - old) * weight
            if load == 0 and average < FORGOTTEN:  # idle long enough: an instance that left
                self._average.pop(iid, None)      # (or went quiet) takes no memory
            else:
                self._average[iid] = average
        self._last_s = now

    def _weight(self, now: float) -> float:
        """How far the averages move towards the held loads between the last event and now."""
        window = self.window_s
        if self._last_s is None or window is None or window <= 0:
            return 0.0
        return 1.0 - math.exp(-max(0.0, now - self._last_s) / window)


__all__ = ["LoadAverages"]
