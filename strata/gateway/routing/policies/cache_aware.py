"""`cache_aware`: a request goes where its prompt's prefix is already cached, within bounded
loads, so a tenant's system prompt is computed once per instance that serves it, not once per
instance of the fleet.

For each candidate i:

    hit_i   = prompt tokens i holds: leading keys the index matches (prefix_index.py) times the
              tokens per key, at most the prompt
    work_i  = the work this gateway has in flight at i: for each request sent there and not
              finished, its uncached prompt tokens when it was routed plus its max_tokens
    cost_i  = (prompt tokens - hit_i) + load_weight * work_i

`cost_i` estimates the tokens i computes before this request's first one: the prefill it saves
against the load it waits behind. The work in flight counts `load_weight` (default one half):
requests in flight are on average half done, and a prefill saved is capacity freed for every
later request, while the wait delays this one only. (With weight 1, a tenant's second request,
arriving while its first still computes the shared prefix, would rather compute the prefix again
elsewhere: same TTFT for it, the prefix's whole cost again for the fleet.) The pick is the
lowest cost among the candidates within the load bound, which has two parts; a candidate is
eligible when either holds:

    now       its requests in flight are under the bound of session routing,
              capacity = ceil((1 + epsilon) * (requests in flight + 1) / candidates)
              (`consistent_hash.bounded_capacity`; the load is `InstanceView.request_load`,
              which also counts what other gateways sent, as reported)
    averaged  its requests in flight averaged over the last mean request duration are under
              (1 + epsilon) times the candidates' mean of those averages (load_average.py)

The first alone keeps every instance within (1 + epsilon) of the mean at every instant, which
on a small fleet is an integer cap one request above the mean (24 in flight over 8 instances:
4 each), so a tenant whose home instance sits at that cap for a moment computes its prefix
again elsewhere, and each copy then draws a share of the tenant's traffic, crowding that
instance's own tenants in turn. Averaged over the time a placement lasts (one request), the load
stays as bounded while a home may take a request above the instantaneous cap; a burst is still
bounded, by the average catching up and by the cost (a home's queued work outweighing the
prefill it saves). Measured by bench/cache_aware_virtual.py (docs/benchmarks.md): 90 -> 95 % of
a single-cache oracle's hit rate at a time-averaged max/mean of 1.1-1.2.

Ties go to fewer requests in flight, then to the instance whose cache holds fewer keys (a new
prefix goes where it evicts least: tenants spread over the fleet), then to the lower `load_key`
and candidate order. It never sheds: some candidate is always under the capacity. A request
without keys (a session turn, /tokenize, an unparsable body) goes to the least work within the
bound.

`choose` is pure over the snapshot, the index and the load averages; the hooks learn:
`on_request_routed` records the prompt's keys for the instance (`PrefixIndex.learn`) and adds
the request's predicted work, `on_request_finished` takes the work away; both move the load
averages. The index and the averages share an injected clock and do no I/O, so a virtual-clock
simulator drives this policy as the gateway does (PrefixIndex.apply for events).
"""

from __future__ import annotations

from collections.abc import Sequence

from strata.errors import ConfigError
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.routing.policies.consistent_hash import DEFAULT_EPSILON, bounded_capacity
from strata.gateway.routing.policies.load_average import LoadAverages
from strata.gateway.routing.prefix.index import PrefixIndex
from strata.gateway.routing.prefix.prompt import uncached_tokens


class CacheAwarePolicy:
    name = "cache_aware"

    def __init__(self, index: PrefixIndex | None = None, *,
                 epsilon: float = DEFAULT_EPSILON, load_weight: float = 0.5) -> None:
        if epsilon <= 0:
            raise ConfigError(f"epsilon must be positive, got {epsilon}")
        if load_weight < 0:
            raise ConfigError(f"load_weight must be >= 0, got {load_weight}")
        self.index = index if index is not None else PrefixIndex()
        self.epsilon = epsilon
        self.load_weight = load_weight
        self._work: dict[str, int] = {}
        self._in_flight: dict[tuple[int, str], int] = {}  # (id of the route, instance) -> work
        self.averages = LoadAverages(self.index.clock)

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        total = sum(view.request_load for view in candidates)
        capacity = bounded_capacity(total + 1, len(candidates), self.epsilon)
        averaged = self.averages.under_bound(candidates, self.epsilon)
        eligible = [view for view in candidates
                    if view.request_load < capacity or view.instance_id in averaged]
        return min(eligible, key=lambda view: (self.cost(request, view), view.request_load,
                                               self.index.num_keys(view.instance_id),
                                               view.load_key))

    def cost(self, request: RouteRequest, view: InstanceView) -> float:
        """Tokens `view` computes before this request's first token (see the module)."""
        work = self._work.get(view.instance_id, 0)
        return self.uncached_tokens(request, view) + self.load_weight * work

    def uncached_tokens(self, request: RouteRequest, view: InstanceView) -> int:
        """The prompt tokens `view` would compute for this request (a decode-only estimate
        when the request has no keys)."""
        return uncached_tokens(self.index, request.prefix, view.instance_id) or 0

    def on_request_routed(self, request: RouteRequest, instance: InstanceView) -> None:
        prefix = request.prefix
        keyset = prefix.for_instance(instance.instance_id) if prefix else None
        if prefix is None or keyset is None:
            work = request.num_tokens
        else:
            work = self.uncached_tokens(request, instance) + prefix.max_tokens
            self.index.learn(instance.instance_id, keyset.keys)
        iid = instance.instance_id
        self.averages.routed(id(request), iid)
        self._in_flight[(id(request), iid)] = work
        self._work[iid] = self._work.get(iid, 0) + work

    def on_request_finished(self, request: RouteRequest, instance: InstanceView,
                            *, is_success: bool) -> None:
        iid = instance.instance_id
        self.averages.finished(id(request), iid)
        work = self._in_flight.pop((id(request), iid), 0)
        left = self._work.get(iid, 0) - work
        if left > 0:
            self._work[iid] = left
        else:
            self._work.pop(iid, None)

    def work(self, instance_id: str) -> int:
        """The predicted work in flight at the instance (tokens)."""
        return self._work.get(instance_id, 0)


__all__ = ["CacheAwarePolicy"]
