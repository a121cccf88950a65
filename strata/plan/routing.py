"""The gateway's part of a plan: the gateway's own routing parts over the plan's instances, and the
KV store's index of stored blocks (KV offload).

    instances   the gateway's `InstanceSet` of the instances' views, with its one in-flight
                accounting (`begin`/`end`)
    pipeline    the gateway's `RoutingPipeline`: its filters and the policy built from the
                policy table on the plan's virtual clock (a policy added to the table runs
                here with no other edit)
    decider     the gateway's P/D `Decider`: which prompts a prefill instance takes

As on the gateway, the decode (or mixed) pick tells the policy (`sent`/`ended`); a prefill leg
is counted in flight only, so a round robin does not count both picks of one request.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

from strata.clock import Clock
from strata.engine.request import Request
from strata.gateway.config import PDRoutingConfig
from strata.gateway.routing.instances import InFlight, InstanceSet, InstanceView
from strata.gateway.routing.pd import Decider, HandOffAsk
from strata.gateway.routing.pipeline import RoutingPipeline
from strata.gateway.routing.policies import CacheAwarePolicy, create_policy
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.routing.prefix.prompt import KeySet, PrefixKeys
from strata.plan.costs import Costs
from strata.plan.instance import PAYLOAD, FleetInstance, SimInstance
from strata.types import BlockHash


@dataclass(slots=True)
class Routed:
    """A request on its way to `instance`, counted in flight until `SimGateway.finished`."""

    instance: FleetInstance
    route: RouteRequest
    in_flight: InFlight
    is_told: bool  # the policy was told (a whole request); a prefill leg is only counted


class SimGateway:
    """The gateway's routing over a plan's instances (see the module docstring)."""

    def __init__(self, policy: str, block_size: int, costs: Costs, rng: random.Random,
                 clock: Clock, *, pd_min_tokens: int) -> None:
        self.block_size = block_size
        self.costs = costs
        self.instances = InstanceSet()
        self.pipeline = RoutingPipeline(self.instances, create_policy(
            policy, rng=random.Random(rng.random()), clock=clock))
        self.decider = Decider(PDRoutingConfig(mode="auto", min_uncached_tokens=pd_min_tokens),
                               self.pipeline)
        self._sims: dict[str, FleetInstance] = {}
        self.stored: set[BlockHash] = set()  # the KV store's block hashes

    def add(self, instance: FleetInstance) -> None:
        self.instances.add(instance.view)
        self._sims[instance.instance_id] = instance

    def prefill_for(self, request: Request, session_id: str | None) -> FleetInstance | None:
        """The prefill instance the gateway's decider hands `request` to; None: not handed off
        (every prompt token counts as uncached, as the gateway's estimate of a prompt of ids)."""
        ask = HandOffAsk(self._route(request, session_id), True, True,
                         lambda decodes: request.num_prompt_tokens)
        chosen = self.decider.decide(ask).prefill
        return None if chosen is None else self._sims[chosen.instance_id]

    def send_prefill(self, instance: FleetInstance, request: Request) -> Routed:
        """The prefill leg on `instance`: counted in flight, the policy not told."""
        route = self._route(request, None, role="prefill")
        return Routed(instance, route, self.instances.begin(instance.view, route.num_tokens),
                      False)

    def route(self, request: Request, session_id: str | None) -> Routed:
        """The pipeline's pick for a whole request (mixed or decode), sent: counted in flight
        and the policy told."""
        route = self._route(request, session_id)
        if isinstance(self.pipeline.policy, CacheAwarePolicy):  # the KeyPrefix step
            route = dataclasses.replace(route, prefix=self._keys(self.pipeline.candidates(route),
                                                                 request))
        decision = self.pipeline.route(route)
        if decision.instance is None:
            raise RuntimeError(f"a plan has no instance for a request: {decision.reason}")
        view = decision.instance
        return Routed(self._sims[view.instance_id], route, self.pipeline.sent(route, view), True)

    def finished(self, routed: Routed, kv_blocks: Sequence[tuple[BlockHash, bytes]]) -> None:
        if routed.is_told:
            self.pipeline.ended(routed.route, routed.in_flight, is_success=True)
        else:
            self.instances.end(routed.in_flight)
        self.stored.update(h for h, _ in kv_blocks)

    def _route(self, request: Request, session_id: str | None,
               role: str | None = None) -> RouteRequest:
        return RouteRequest(role=role, session_id=session_id,
                            num_tokens=request.num_prompt_tokens
                            + request.sampling_params.max_tokens)

    def _keys(self, candidates: Sequence[InstanceView], request: Request) -> PrefixKeys | None:
        """cache_aware's keys: the engine's own block hashes (every instance of a plan shares
        one namespace, so one key set serves them all)."""
        if not candidates:
            return None
        ids = [view.instance_id for view in candidates]
        hashes = _engine_of(self._sims[ids[0]]).engine.block_hashes(request.prompt_token_ids)
        keyset = KeySet(tuple(hashes), self.block_size, request.num_prompt_tokens)
        return PrefixKeys(dict.fromkeys(ids, keyset), request.sampling_params.max_tokens)

    def attach_stored_kv(self, fleet_instance: FleetInstance, request: Request) -> int:
        """As the server's KV offload: the stored run of blocks past the instance's local hit
        is fetched (attached to the request) when the prompt is long enough; the request
        exports the blocks not stored yet. Returns the tokens fetched."""
        instance = _engine_of(fleet_instance)
        hashes = instance.engine.block_hashes(request.prompt_token_ids)
        num_local = instance.engine.num_cached_blocks(hashes)
        num_stored = next((n for n, h in enumerate(hashes) if h not in self.stored), len(hashes))
        request.kv_export = True
        request.kv_export_start_block = num_stored
        if num_stored <= num_local or request.num_prompt_tokens < self.costs.kv_min_fetch_tokens:
            return 0
        request.external_kv = dict.fromkeys(hashes[num_local:num_stored], PAYLOAD)
        return (num_stored - num_local) * self.block_size


def _engine_of(instance: FleetInstance) -> SimInstance:
    """Block hashes come from a real engine: cache-aware routing and KV offload are planned over
    the engine's instances, never over the capacity model's (modelled.py), which has no blocks."""
    if not isinstance(instance, SimInstance):
        raise TypeError("cache-aware routing and KV offload need the engine's instances")
    return instance


__all__ = ["Routed", "SimGateway"]
