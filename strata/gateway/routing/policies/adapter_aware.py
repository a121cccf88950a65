"""`adapter_aware`: each LoRA adapter is served by a small, stable set of instances, so that
an adapter is loaded where its requests go and nowhere else, while no instance takes more than
its share of the load.

Routing to the least loaded instance loads every adapter everywhere (each instance cycles every
adapter through its slots: a cold load on most requests of a rare one); routing to where an
adapter is loaded piles a hot adapter on the instances that loaded it first, and a rare one
evicts whatever was there. Here (Dynamo's answer, with the bounded loads of session routing):

    home    the adapter's instances in rendezvous order: by stable_hash(adapter | instance id),
            highest first (highest random weight, Thaler and Ravishankar 1998). The first k are
            its home set; an instance that leaves moves only the adapters it was home to, and
            one that joins takes a share of each adapter's homes (no reshuffle of the rest)
    k       from the adapter's share of the requests (adapter_demand.py): 1 for a rare adapter,
            growing with demand, shrinking with hysteresis; a hot adapter gets a part of the
            fleet in proportion to its traffic, never every instance unless it is most of it
    bound   an instance is eligible while its requests in flight are under the session bound,
            ceil((1 + epsilon) * (requests in flight + 1) / candidates) (consistent_hash.py),
            or averaged over the mean request duration under (1 + epsilon) times the mean of
            those averages (load_average.py, as `cache_aware`): a home at the instantaneous cap
            for a moment keeps its adapter instead of loading it on another instance, where it
            would evict another adapter (bench/lora_placement.py: 22 -> 19 cold loads per 100
            requests, time-averaged max/mean 1.11 -> 1.19)

The pick, among the eligible instances: one that is warm, home ones first, then the least
loaded; else the least loaded home; else the next in rendezvous order past the home set (so a
spill lands on the same few instances each time, which then hold the adapter too). Warm is what
the instance last reported resident (`InstanceView.is_resident`) or where this gateway sent the
adapter in the last `warm_s`: a request runs where its adapter is while that instance is under
the bound, and a load happens on a home, never on a random instance. Requests for the base model
(and every other request) go to the least loaded candidate.

Gateways agree on homes without talking: the order is a hash every process computes alike; k
is each gateway's own measure of the adapter's share, the same wherever the traffic mix is.

`choose` is pure over the snapshot, the demand table, the load averages and the warm marks;
the routed hook counts the request in the adapter's demand, marks the instance warm and moves
the averages, the finished hook moves them back.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

from strata.clock import Clock
from strata.errors import ConfigError
from strata.gateway.config import AdapterPlacementConfig
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies.adapter_demand import DemandTable
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.routing.policies.consistent_hash import (
    DEFAULT_EPSILON,
    bounded_capacity,
    stable_hash,
)
from strata.gateway.routing.policies.load_average import LoadAverages


@functools.lru_cache(maxsize=65536)
def rendezvous_weight(adapter: str, instance_id: str) -> int:
    """The adapter's weight on the instance: the same in every gateway process."""
    return stable_hash(f"{adapter}|{instance_id}")


def rendezvous_order(adapter: str, candidates: Sequence[InstanceView]) -> list[InstanceView]:
    """`candidates` by the adapter's weight on each, highest first."""
    return sorted(candidates, key=lambda view: rendezvous_weight(adapter, view.instance_id),
                  reverse=True)


def adapter_of(request: RouteRequest, candidates: Sequence[InstanceView]) -> str | None:
    """The LoRA adapter the request names (None: the base model, or no model)."""
    model = request.model
    if model is None or not candidates or model == candidates[0].model:
        return None
    return model


class AdapterAwarePolicy:
    name = "adapter_aware"

    def __init__(self, config: AdapterPlacementConfig | None = None, *,
                 epsilon: float = DEFAULT_EPSILON, clock: Clock = time.monotonic) -> None:
        if epsilon <= 0:
            raise ConfigError(f"epsilon must be positive, got {epsilon}")
        self.config = config if config is not None else AdapterPlacementConfig()
        self.epsilon = epsilon
        self.clock = clock
        self.demand = DemandTable(self.config, clock)
        self._sent_at: dict[tuple[str, str], float] = {}  # (adapter, instance id) -> last sent
        self.averages = LoadAverages(clock)

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        adapter = adapter_of(request, candidates)
        if adapter is None:
            return min(candidates, key=lambda view: view.load_key)
        eligible = self.eligible(adapter, candidates)
        warm = [(is_home, view) for is_home, view in eligible if self.is_warm(adapter, view)]
        if warm:
            return min(warm, key=lambda pair: (not pair[0], pair[1].load_key))[1]
        home = [view for is_home, view in eligible if is_home]
        return min(home, key=lambda view: view.load_key) if home else eligible[0][1]

    def eligible(self, adapter: str, candidates: Sequence[InstanceView]
                 ) -> list[tuple[bool, InstanceView]]:
        """The candidates within the bound (now or averaged), in rendezvous order, each with
        whether it is in the adapter's home set; never empty."""
        total = sum(view.request_load for view in candidates)
        capacity = bounded_capacity(total + 1, len(candidates), self.epsilon)
        averaged = self.averages.under_bound(candidates, self.epsilon)
        k = self.demand.replicas(adapter, len(candidates))
        eligible = [(rank < k, view)
                    for rank, view in enumerate(rendezvous_order(adapter, candidates))
                    if view.request_load < capacity or view.instance_id in averaged]
        if not eligible:
            raise AssertionError("bounded capacity invariant broken: every instance is full")
        return eligible

    def home(self, adapter: str, candidates: Sequence[InstanceView]) -> list[InstanceView]:
        """The adapter's home set among `candidates` now (its first k in rendezvous order)."""
        return rendezvous_order(adapter, candidates)[:self.demand.replicas(adapter,
                                                                           len(candidates))]

    def is_warm(self, adapter: str, view: InstanceView) -> bool:
        """Whether `view` holds the adapter, as it reported or as this gateway sent it there."""
        if view.is_resident(adapter):
            return True
        sent_at = self._sent_at.get((adapter, view.instance_id))
        return sent_at is not None and self.clock() - sent_at < self.config.warm_s

    def on_request_routed(self, request: RouteRequest, instance: InstanceView) -> None:
        self.averages.routed(id(request), instance.instance_id)
        adapter = request.model
        if adapter is None or adapter == instance.model:
            return
        self.demand.observe(adapter)
        self._sent_at[(adapter, instance.instance_id)] = self.clock()
        if len(self._sent_at) > 4 * 65536:  # old marks are cold anyway: keep the map bounded
            self._forget_cold()

    def on_request_finished(self, request: RouteRequest, instance: InstanceView,
                            *, is_success: bool) -> None:
        self.averages.finished(id(request), instance.instance_id)

    def _forget_cold(self) -> None:
        now = self.clock()
        self._sent_at = {key: at for key, at in self._sent_at.items()
                         if now - at < self.config.warm_s}


__all__ = ["AdapterAwarePolicy", "adapter_of", "rendezvous_order", "rendezvous_weight"]
