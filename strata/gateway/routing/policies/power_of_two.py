"""Power of two choices: sample two candidates at random, take the less loaded.

Almost as good as least load at spreading work, without herding every gateway onto the same
instance when their load views are stale. Ties go to the first one sampled.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies.base import RouteRequest, StatelessPolicy


class PowerOfTwoPolicy(StatelessPolicy):
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng if rng is not None else random.Random()

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self.rng.sample(list(candidates), 2)
        return second if second.load_key < first.load_key else first


__all__ = ["PowerOfTwoPolicy"]
