"""Routing policies and their factory.

    round_robin    candidates in turn
    least_load     the least loaded (gateway accounting + instance-reported load)
    power_of_two   the less loaded of two random candidates (default)
    consistent_hash  a session's requests to one instance, bounded loads (ceil((1+eps)*mean))
"""

from __future__ import annotations

import random
from collections.abc import Callable

from strata.errors import ConfigError
from strata.gateway.policies.base import RouteRequest, RoutingPolicy, StatelessPolicy
from strata.gateway.policies.consistent_hash import ConsistentHashPolicy
from strata.gateway.policies.least_load import LeastLoadPolicy
from strata.gateway.policies.power_of_two import PowerOfTwoPolicy
from strata.gateway.policies.round_robin import RoundRobinPolicy

_FACTORIES: dict[str, Callable[[random.Random | None], RoutingPolicy]] = {
    "power_of_two": lambda rng: PowerOfTwoPolicy(rng),
    "round_robin": lambda rng: RoundRobinPolicy(),
    "least_load": lambda rng: LeastLoadPolicy(),
    "consistent_hash": lambda rng: ConsistentHashPolicy(),
}


def create_policy(name: str, *, rng: random.Random | None = None) -> RoutingPolicy:
    """The policy called `name`; `rng` seeds the randomised ones."""
    factory = _FACTORIES.get(name)
    if factory is None:
        valid = ", ".join(sorted(_FACTORIES))
        raise ConfigError(f"unknown routing policy {name!r}; valid policies: {valid}")
    return factory(rng)


__all__ = ["ConsistentHashPolicy", "LeastLoadPolicy", "PowerOfTwoPolicy", "RoundRobinPolicy",
           "RouteRequest", "RoutingPolicy", "StatelessPolicy", "create_policy"]
