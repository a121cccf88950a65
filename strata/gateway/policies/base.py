"""The routing policy contract.

A policy ranks candidates over a snapshot: `choose` is a pure function of the request and the
candidates (which the pipeline has already filtered to routable instances serving the request's
model; never empty). What a policy learns from routing happens in the hooks, which the proxy calls
once per attempt: `on_request_routed` when a request is sent to an instance, and
`on_request_finished` when that attempt ends (success or not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from strata.gateway.instances import InstanceView


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing knows of a request (parsed from its body and headers; the body itself is
    forwarded untouched)."""

    model: str | None = None
    version: str | None = None
    role: str | None = None
    pool: str | None = None
    session_id: str | None = None
    is_stream: bool = False
    num_tokens: int = 0  # estimate: prompt bytes / 4 + max_tokens


class RoutingPolicy(Protocol):
    """Picks one instance among routable candidates."""

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        """The instance to try; `candidates` is non-empty and ordered by instance id."""
        ...

    def on_request_routed(self, request: RouteRequest, instance: InstanceView) -> None:
        """Called once the request is sent to `instance`."""
        ...

    def on_request_finished(self, request: RouteRequest, instance: InstanceView,
                            *, is_success: bool) -> None:
        """Called when the attempt on `instance` ends."""
        ...


class StatelessPolicy:
    """Base for policies that learn nothing from routing (hooks do nothing)."""

    name = "stateless"

    def on_request_routed(self, request: RouteRequest, instance: InstanceView) -> None:
        return None

    def on_request_finished(self, request: RouteRequest, instance: InstanceView,
                            *, is_success: bool) -> None:
        return None


__all__ = ["RouteRequest", "RoutingPolicy", "StatelessPolicy"]
