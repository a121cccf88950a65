"""Routing policies: one table from policy name to its row (`POLICIES`), which the CLI's
`--policy` choices, `create_policy` and the capacity planner (`strata plan`) read.

    power_of_two     the less loaded of two random candidates (the default)
    round_robin      candidates in turn
    least_load       the least loaded (gateway accounting + instance-reported load)
    consistent_hash  a session's requests to one instance, bounded loads (ceil((1+eps)*mean));
                     eps and the virtual nodes per instance come from the session settings
    cache_aware      where the prompt's prefix is cached (the instances' KV events), against
                     the work in flight, within the same bounded loads (cache_aware.py)
    adapter_aware    a LoRA adapter's requests to its home set of k instances (rendezvous
                     order, k from its demand), within the same bounded loads
                     (adapter_aware.py); base-model requests to the least loaded

Adding a policy is one file in this package (a class with `choose` and the two hooks of
`RoutingPolicy`, see base.py) plus one row in `POLICIES`; code outside the package (a test, a
plugin) adds its row with `register_policy`. The row's factory gets a `PolicyContext`: the
gateway's settings, its random generator and its clock. A policy that keeps time reads that
clock and nothing else, so the planner runs it on its virtual clock with no other edit; a row's
`wants` names the workloads it is meant for ("sessions", "prefix"), so the planner tries it where
it applies.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from strata.clock import Clock
from strata.errors import ConfigError
from strata.gateway.config import GatewayConfig
from strata.gateway.routing.policies.adapter_aware import AdapterAwarePolicy
from strata.gateway.routing.policies.base import RouteRequest, RoutingPolicy, StatelessPolicy
from strata.gateway.routing.policies.cache_aware import CacheAwarePolicy
from strata.gateway.routing.policies.consistent_hash import ConsistentHashPolicy
from strata.gateway.routing.policies.least_load import LeastLoadPolicy
from strata.gateway.routing.policies.power_of_two import PowerOfTwoPolicy
from strata.gateway.routing.policies.round_robin import RoundRobinPolicy
from strata.gateway.routing.prefix.index import PrefixIndex

WORKLOAD_TRAITS = ("sessions", "prefix", "adapters")  # what a row's `wants` may name


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy is built from: the gateway's settings, its random generator (None:
    unseeded) and its clock (the gateway's monotonic clock, a test's fake, a plan's virtual
    clock)."""

    config: GatewayConfig = field(default_factory=GatewayConfig)
    rng: random.Random | None = None
    clock: Clock = time.monotonic


PolicyFactory = Callable[[PolicyContext], RoutingPolicy]


@dataclass(frozen=True, slots=True)
class PolicyRow:
    """One row of the table: how to build the policy, and the workloads it is meant for (none:
    every workload)."""

    factory: PolicyFactory
    wants: frozenset[str] = frozenset()

    def applies_to(self, traits: Collection[str]) -> bool:
        """Whether a workload with `traits` is one this policy is meant for."""
        return not self.wants or bool(self.wants & set(traits))


POLICIES: dict[str, PolicyRow] = {
    "power_of_two": PolicyRow(lambda ctx: PowerOfTwoPolicy(ctx.rng)),
    "round_robin": PolicyRow(lambda ctx: RoundRobinPolicy()),
    "least_load": PolicyRow(lambda ctx: LeastLoadPolicy()),
    "consistent_hash": PolicyRow(lambda ctx: ConsistentHashPolicy(
        epsilon=ctx.config.sessions.epsilon, num_vnodes=ctx.config.sessions.num_vnodes),
        wants=frozenset({"sessions"})),
    "cache_aware": PolicyRow(lambda ctx: CacheAwarePolicy(
        PrefixIndex(clock=ctx.clock), epsilon=ctx.config.sessions.epsilon),
        wants=frozenset({"prefix"})),
    "adapter_aware": PolicyRow(lambda ctx: AdapterAwarePolicy(
        ctx.config.adapters, epsilon=ctx.config.sessions.epsilon, clock=ctx.clock),
        wants=frozenset({"adapters"})),
}


def policy_names() -> tuple[str, ...]:
    """Every policy name, in table order (the default first)."""
    return tuple(POLICIES)


def register_policy(name: str, factory: PolicyFactory, *, wants: Collection[str] = ()) -> None:
    """Adds a row to `POLICIES`; a name already there is refused, never replaced."""
    if name in POLICIES:
        raise ConfigError(f"routing policy {name!r} is already registered")
    unknown = set(wants) - set(WORKLOAD_TRAITS)
    if unknown:
        raise ConfigError(f"a policy wants workloads with {', '.join(WORKLOAD_TRAITS)}; got "
                          f"{', '.join(sorted(unknown))}")
    POLICIES[name] = PolicyRow(factory, frozenset(wants))


def policy_row(name: str) -> PolicyRow:
    """The row called `name`; a ConfigError listing the table when there is none."""
    row = POLICIES.get(name)
    if row is None:
        valid = ", ".join(sorted(POLICIES))
        raise ConfigError(f"unknown routing policy {name!r}; valid policies: {valid}")
    return row


def create_policy(name: str, *, config: GatewayConfig | None = None,
                  rng: random.Random | None = None, clock: Clock = time.monotonic
                  ) -> RoutingPolicy:
    """The policy called `name`, built from `config` (default: every setting's default); `rng`
    seeds the randomised ones, `clock` is the only time a policy reads."""
    context = PolicyContext(config if config is not None else GatewayConfig(), rng, clock)
    return policy_row(name).factory(context)


__all__ = ["POLICIES", "WORKLOAD_TRAITS", "AdapterAwarePolicy", "CacheAwarePolicy",
           "ConsistentHashPolicy", "LeastLoadPolicy", "PolicyContext", "PolicyFactory",
           "PolicyRow", "PowerOfTwoPolicy",
           "RoundRobinPolicy", "RouteRequest", "RoutingPolicy", "StatelessPolicy",
           "create_policy", "policy_names", "policy_row", "register_policy"]
