"""The gateway's part of a plan: the real routing policy of each pool with the proxy's
in-flight accounting and hooks, and the KV store's index of stored blocks (KV offload)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from strata.clock import Clock
from strata.engine.request import Request
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies import CacheAwarePolicy, RoutingPolicy, create_policy
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.routing.prefix.prompt import KeySet, PrefixKeys
from strata.plan.costs import Costs
from strata.plan.instance import PAYLOAD, SimInstance
from strata.types import BlockHash


class SimGateway:
    def __init__(self, policy: str, block_size: int, costs: Costs,
                 rng: random.Random, clock: Clock) -> None:
        self.policy_name = policy
        self.block_size = block_size
        self.costs = costs
        self.policies: dict[str, RoutingPolicy] = {
            role: create_policy(policy, rng=random.Random(rng.random()))
            for role in ("mixed", "prefill")}
        for each in self.policies.values():
            if isinstance(each, CacheAwarePolicy):  # its index and load averages keep time
                each.index.clock = each.averages.clock = clock  # on the plan's virtual clock
        self.stored: set[BlockHash] = set()  # the KV store's block hashes

    def route(self, candidates: Sequence[SimInstance], request: Request,
              session_id: str | None) -> tuple[SimInstance, RouteRequest]:
        """The policy's pick among `candidates` (routable, one role), accounted as sent."""
        views = [i.view for i in candidates]
        route = RouteRequest(session_id=session_id, num_tokens=request.num_prompt_tokens
                             + request.sampling_params.max_tokens,
                             prefix=self._keys(candidates, request))
        policy = self.policies[candidates[0].view.role]
        view = policy.choose(route, views)
        policy.on_request_routed(route, view)
        view.num_in_flight += 1
        view.num_in_flight_tokens += route.num_tokens
        return candidates[views.index(view)], route

    def finished(self, view: InstanceView, route: RouteRequest,
                 kv_blocks: Sequence[tuple[BlockHash, bytes]]) -> None:
        view.num_in_flight -= 1
        view.num_in_flight_tokens -= route.num_tokens
        self.policies[view.role].on_request_finished(route, view, is_success=True)
        self.stored.update(h for h, _ in kv_blocks)

    def _keys(self, candidates: Sequence[SimInstance], request: Request) -> PrefixKeys | None:
        """cache_aware's keys: the engine's own block hashes (every instance of a plan shares
        one namespace, so one key set serves them all)."""
        if self.policy_name != "cache_aware":
            return None
        hashes = candidates[0].engine.block_hashes(request.prompt_token_ids)
        keyset = KeySet(tuple(hashes), self.block_size, request.num_prompt_tokens)
        return PrefixKeys({i.instance_id: keyset for i in candidates},
                          request.sampling_params.max_tokens)

    def attach_stored_kv(self, instance: SimInstance, request: Request) -> int:
        """As the server's KV offload: the stored run of blocks past the instance's local hit
        is fetched (attached to the request) when the prompt is long enough; the request
        exports the blocks not stored yet. Returns the tokens fetched."""
        hashes = instance.engine.block_hashes(request.prompt_token_ids)
        num_local = instance.engine.num_cached_blocks(hashes)
        num_stored = next((n for n, h in enumerate(hashes) if h not in self.stored), len(hashes))
        request.kv_export = True
        request.kv_export_start_block = num_stored
        if num_stored <= num_local or request.num_prompt_tokens < self.costs.kv_min_fetch_tokens:
            return 0
        request.external_kv = dict.fromkeys(hashes[num_local:num_stored], PAYLOAD)
        return (num_stored - num_local) * self.block_size


__all__ = ["SimGateway"]
