"""The routing policy contract.

A policy picks ONE instance: `choose` is a pure function of the request and the candidates (the
pipeline has already filtered them to routable instances serving the request's model, version,
role and pool; never empty, ordered by instance id). What a policy learns from routing happens
in the hooks, which the proxy calls once per attempt: `on_request_routed` when a request is sent
to an instance, and `on_request_finished` when that attempt ends (success or not). A retry asks
`choose` again, over the candidates not tried yet.

Why one instance and not ranked groups (Ray Serve's router has a policy return groups of
replicas in order of preference, then probes the replicas of a group for queue room and takes
one): a Strata gateway does not probe instances, every load figure a policy weighs is already in
the snapshot, so the policy itself can make the final pick; with groups, the pick inside a group
would be a second rule beside the policy. Nor would a ranking be reused: a retry re-asks over
fresh loads, so every rank after the first would be computed and thrown away on each request.
Preferences compose by wrapping instead: session pinning is a policy around the configured one
(`PinnedSessionPolicy` in strata/gateway/path/sessions.py), so the pipeline has one way to choose.

Adding a policy: one module in this package and one row in `POLICIES`
(strata/gateway/routing/policies/__init__.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.prefix.prompt import PrefixKeys


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
    prefix: PrefixKeys | None = None  # the prompt's keys per candidate (cache_aware only)
    priority: int = 0  # higher = more important (strata/protocol/priority.py), key-clamped


class RoutingPolicy(Protocol):
    """Picks one instance among routable candidates; `name` is its row in the policy table."""

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
