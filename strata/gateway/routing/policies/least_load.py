"""Least load: the candidate with the smallest `InstanceView.load_key`.

The key is (requests queued or running there, tokens the gateway has in flight there, reported KV
usage); ties go to the lowest instance id.
"""

from __future__ import annotations

from collections.abc import Sequence

from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies.base import RouteRequest, StatelessPolicy


class LeastLoadPolicy(StatelessPolicy):
    name = "least_load"

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        return min(candidates, key=lambda view: view.load_key)


__all__ = ["LeastLoadPolicy"]
