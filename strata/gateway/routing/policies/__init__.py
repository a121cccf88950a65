"""Routing policies: one table from policy name to factory (`POLICIES`), which the CLI's
`--policy` choices and `create_policy` read.

    power_of_two     the less loaded of two random candidates (the default)
    round_robin      candidates in turn
    least_load       the least loaded (gateway accounting + instance-reported load)
    consistent_hash  a session's requests to one instance, bounded loads (ceil((1+eps)*mean));
                     eps and the virtual nodes per instance come from the session settings
    cache_aware      where the prompt's prefix is cached (the instances' KV events), against
                     the work in flight, within the same bounded loads (cache_aware.py)

Adding a policy is one file in this package (a class with `choose` and the two hooks of
`RoutingPolicy`, see base.py) plus one row in `POLICIES`. Code outside the package (a test, a
plugin) adds its row with `register_policy`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from strata.errors import ConfigError
from strata.gateway.config import GatewayConfig
from strata.gateway.routing.policies.base import RouteRequest, RoutingPolicy, StatelessPolicy
from strata.gateway.routing.policies.cache_aware import CacheAwarePolicy
from strata.gateway.routing.policies.consistent_hash import ConsistentHashPolicy
from strata.gateway.routing.policies.least_load import LeastLoadPolicy
from strata.gateway.routing.policies.power_of_two import PowerOfTwoPolicy
from strata.gateway.routing.policies.round_robin import RoundRobinPolicy

# the gateway's settings and the gateway's rng (None: unseeded) -> a fresh policy
PolicyFactory = Callable[[GatewayConfig, random.Random | None], RoutingPolicy]

POLICIES: dict[str, PolicyFactory] = {
    "power_of_two": lambda config, rng: PowerOfTwoPolicy(rng),
    "round_robin": lambda config, rng: RoundRobinPolicy(),
    "least_load": lambda config, rng: LeastLoadPolicy(),
    "consistent_hash": lambda config, rng: ConsistentHashPolicy(
        epsilon=config.sessions.epsilon, num_vnodes=config.sessions.num_vnodes),
    "cache_aware": lambda config, rng: CacheAwarePolicy(epsilon=config.sessions.epsilon),
}


def policy_names() -> tuple[str, ...]:
    """Every policy name, in table order (the default first)."""
    return tuple(POLICIES)


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Adds a row to `POLICIES`; a name already there is refused, never replaced."""
    if name in POLICIES:
        raise ConfigError(f"routing policy {name!r} is already registered")
    POLICIES[name] = factory


def create_policy(name: str, *, config: GatewayConfig | None = None,
                  rng: random.Random | None = None) -> RoutingPolicy:
    """The policy called `name`, built from `config` (default: every setting's default); `rng`
    seeds the randomised ones."""
    factory = POLICIES.get(name)
    if factory is None:
        valid = ", ".join(sorted(POLICIES))
        raise ConfigError(f"unknown routing policy {name!r}; valid policies: {valid}")
    return factory(config if config is not None else GatewayConfig(), rng)


__all__ = ["POLICIES", "CacheAwarePolicy", "ConsistentHashPolicy", "LeastLoadPolicy",
           "PolicyFactory", "PowerOfTwoPolicy", "RoundRobinPolicy", "RouteRequest", "RoutingPolicy",
           "StatelessPolicy", "create_policy", "policy_names", "register_policy"]
