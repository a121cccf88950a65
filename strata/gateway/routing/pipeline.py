"""Routing pipeline: filters -> policy -> pick, over a snapshot of the instance set.

Filters keep instances that are routable (ready, not ejected, not draining) and match the request's
model, version, role and pool. The result is narrow: an instance, or the status and reason why
there is none (404 when no known instance serves the model at all, 503 when some do but none can
take the request now).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from strata.gateway.routing.instances import InFlight, InstanceSet, InstanceView
from strata.gateway.routing.policies.base import RouteRequest, RoutingPolicy

Filter = Callable[[RouteRequest, InstanceView], bool]


def is_routable(request: RouteRequest, view: InstanceView) -> bool:
    return view.is_routable


def serves_version(request: RouteRequest, view: InstanceView) -> bool:
    return request.version is None or view.version == request.version


def has_role(request: RouteRequest, view: InstanceView) -> bool:
    """A requested role keeps that role only. Without one, the instances that take whole
    requests: `mixed` and `decode` (which prefills itself what is not handed over)."""
    if request.role is not None:
        return view.role == request.role
    return view.role != "prefill"


def in_pool(request: RouteRequest, view: InstanceView) -> bool:
    return request.pool is None or view.pool == request.pool


def serves_model(request: RouteRequest, view: InstanceView) -> bool:
    """The request's model is the instance's base model or a LoRA adapter it knows."""
    return request.model is None or view.serves(request.model)


FILTERS: tuple[Filter, ...] = (serves_model, is_routable, serves_version, has_role, in_pool)


MAX_NAMES_LISTED = 20  # a fleet of many LoRA adapters: the error names a few, counts the rest


def names_listed(names: list[str]) -> str:
    """`names` joined, the first MAX_NAMES_LISTED of them and how many more."""
    shown = ", ".join(names[:MAX_NAMES_LISTED])
    more = len(names) - MAX_NAMES_LISTED
    return f"{shown} and {more} more (GET /v1/models lists them)" if more > 0 else shown


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """`instance`, or `status_code` (404/503) and `reason` when there is none;
    `num_candidates`: the instances the policy chose among."""

    instance: InstanceView | None
    status_code: int = 200
    reason: str = ""
    num_candidates: int = 0


class RoutingPipeline:
    """Filters, then the policy (with pinned sessions, the policy that places them first).
    `route` does not change any state; the caller says `sent` when it actually sends the
    request (counted in flight, the policy's hook) and `ended` when that attempt ends."""

    def __init__(self, instances: InstanceSet, policy: RoutingPolicy,
                 filters: tuple[Filter, ...] = FILTERS) -> None:
        self.instances = instances
        self.policy = policy
        self.filters = filters

    def candidates(self, request: RouteRequest,
                   exclude: Collection[str] = ()) -> list[InstanceView]:
        """Views passing every filter, minus `exclude` (ids already tried), by id."""
        return [view for view in self.instances.snapshot()
                if view.instance_id not in exclude
                and all(keep(request, view) for keep in self.filters)]

    def route(self, request: RouteRequest, exclude: Collection[str] = ()) -> RouteDecision:
        candidates = self.candidates(request, exclude)
        if candidates:
            return RouteDecision(self.policy.choose(request, candidates),
                                 num_candidates=len(candidates))
        return self._no_instance(request, exclude)

    def sent(self, request: RouteRequest, view: InstanceView) -> InFlight:
        """`request` went to `view`: counted in flight there, the policy told."""
        in_flight = self.instances.begin(view, request.num_tokens)
        self.policy.on_request_routed(request, view)
        return in_flight

    def ended(self, request: RouteRequest, in_flight: InFlight, *, is_success: bool) -> None:
        """The attempt `sent` returned `in_flight` for is over (once: a second call does
        nothing)."""
        if self.instances.end(in_flight):
            self.policy.on_request_finished(request, in_flight.view, is_success=is_success)

    def _no_instance(self, request: RouteRequest, exclude: Collection[str]) -> RouteDecision:
        known = {name for view in self.instances.snapshot() if view.model
                 for name in (view.model, *view.reported.adapters)}
        if request.model is not None and request.model not in known:
            listed = names_listed(sorted(known)) or "none"
            return RouteDecision(None, 404, f"The model `{request.model}` does not exist; "
                                            f"models served: {listed}")
        what = f"model `{request.model}`" if request.model else "this request"
        detail = f" (version {request.version})" if request.version else ""
        tried = " that has not already failed" if exclude else ""
        return RouteDecision(None, 503, f"no instance{tried} is available for {what}{detail}; "
                                        "retry later")


__all__ = ["FILTERS", "Filter", "RouteDecision", "RoutingPipeline"]
