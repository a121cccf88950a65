"""Round robin over the candidates, in instance-id order."""

from __future__ import annotations

from collections.abc import Sequence

from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies.base import RouteRequest, StatelessPolicy


class RoundRobinPolicy(StatelessPolicy):
    """The n-th routed request goes to candidate n mod len(candidates)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._num_routed = 0

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        return candidates[self._num_routed % len(candidates)]

    def on_request_routed(self, request: RouteRequest, instance: InstanceView) -> None:
        self._num_routed += 1


__all__ = ["RoundRobinPolicy"]
