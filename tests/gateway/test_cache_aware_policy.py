"""The cache-aware score under load skew: a cached prefix wins while its instance is under the
bounded-load capacity and its work in flight does not outweigh the prefill it saves; the hooks
learn where prompts went; nothing is ever shed."""

from __future__ import annotations

import math

from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies import CacheAwarePolicy, create_policy
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.routing.prefix.index import BlockBatch, PrefixIndex
from strata.gateway.routing.prefix.prompt import KeySet, PrefixKeys

BLOCK = 16
PREFIX = tuple(bytes([i]) * 16 for i in range(60))  # a 960-token system prompt
OTHER = tuple(bytes([100 + i]) * 16 for i in range(60))


def views(n: int) -> list[InstanceView]:
    return [InstanceView(f"i{k}", f"http://i{k}", "m") for k in range(n)]


def request(keys: tuple[bytes, ...] = PREFIX, ids: list[str] | None = None,
            max_tokens: int = 32) -> RouteRequest:
    keyset = KeySet(keys, BLOCK, len(keys) * BLOCK + 40)
    by_instance = {iid: keyset for iid in (ids or [f"i{k}" for k in range(8)])}
    return RouteRequest(model="m", num_tokens=1200, prefix=PrefixKeys(by_instance, max_tokens))


def cached_at(policy: CacheAwarePolicy, instance_id: str, keys: tuple[bytes, ...]) -> None:
    policy.index.apply(instance_id, BlockBatch(1.0, 1, list(keys), is_snapshot=True))


def test_the_instance_holding_the_prefix_wins_when_loads_are_even() -> None:
    policy = CacheAwarePolicy(PrefixIndex())
    fleet = views(4)
    cached_at(policy, "i2", PREFIX)
    assert policy.choose(request(), fleet).instance_id == "i2"
    assert policy.uncached_tokens(request(), fleet[2]) == 40
    assert policy.uncached_tokens(request(), fleet[0]) == 1000


def test_load_skew_the_bound_moves_a_hot_prefix_off_a_full_instance() -> None:
    policy = CacheAwarePolicy(PrefixIndex(), epsilon=0.25)
    fleet = views(4)
    cached_at(policy, "i0", PREFIX)
    fleet[0].num_in_flight = 3  # capacity = ceil(1.25 * (3 + 1) / 4) = 2: i0 is full
    assert math.ceil(1.25 * 4 / 4) == 2
    choice = policy.choose(request(), fleet)
    assert choice.instance_id != "i0"
    fleet[1].num_in_flight = fleet[2].num_in_flight = fleet[3].num_in_flight = 2
    # in flight 9 (+1): capacity ceil(1.25 * 10 / 4) = 4: i0 (3) is eligible again and wins
    assert policy.choose(request(), fleet).instance_id == "i0"


def test_work_in_flight_outweighs_a_small_saving() -> None:
    policy = CacheAwarePolicy(PrefixIndex(), epsilon=10.0)  # a loose bound: the cost decides
    fleet = views(2)
    short = PREFIX[:4]  # a 64-token shared prefix saves little
    cached_at(policy, "i0", short)
    req = request(short, ["i0", "i1"])
    assert policy.choose(req, fleet).instance_id == "i0"
    for _ in range(3):  # three requests of another prefix in flight at i0: the first computes
        policy.on_request_routed(request(OTHER, ["i0", "i1"]), fleet[0])  # its whole prompt,
    assert policy.work("i0") == (1000 + 32) + 2 * (40 + 32)  # the next two hit its blocks
    assert policy.choose(req, fleet).instance_id == "i1"


def test_hooks_learn_the_prefix_and_account_work_until_finished() -> None:
    policy = CacheAwarePolicy(PrefixIndex())
    fleet = views(3)
    first = request()
    chosen = policy.choose(first, fleet)
    policy.on_request_routed(first, chosen)
    assert policy.work(chosen.instance_id) == 1000 + 32  # the whole prompt, then max_tokens
    second = request()  # the same prefix, before any event: routing history sends it along
    assert policy.choose(second, fleet) is chosen
    assert policy.uncached_tokens(second, chosen) == 40
    policy.on_request_finished(first, chosen, is_success=True)
    assert policy.work(chosen.instance_id) == 0


def test_new_prefixes_spread_over_instances_that_hold_least() -> None:
    policy = CacheAwarePolicy(PrefixIndex())
    fleet = views(3)
    cached_at(policy, "i0", OTHER)
    policy.index.learn("i1", OTHER[:10])
    fresh = tuple(bytes([200]) * 15 + bytes([i]) for i in range(8))
    assert policy.choose(request(fresh), fleet).instance_id == "i2"


def test_never_sheds_and_never_exceeds_the_bound() -> None:
    policy = CacheAwarePolicy(PrefixIndex(), epsilon=0.25)
    fleet = views(8)
    cached_at(policy, "i3", PREFIX)
    for _ in range(200):  # every request shares one prefix; none finishes
        req = request()
        chosen = policy.choose(req, fleet)
        total = sum(v.num_in_flight for v in fleet)
        assert chosen.num_in_flight < math.ceil(1.25 * (total + 1) / 8)
        chosen.num_in_flight += 1
        policy.on_request_routed(req, chosen)
    loads = [v.num_in_flight for v in fleet]
    assert sum(loads) == 200 and max(loads) <= math.ceil(1.25 * 200 / 8)


def test_requests_without_keys_go_to_the_least_work() -> None:
    policy = create_policy("cache_aware")
    assert isinstance(policy, CacheAwarePolicy)
    fleet = views(2)
    policy.on_request_routed(RouteRequest(num_tokens=500), fleet[0])
    assert policy.choose(RouteRequest(num_tokens=10), fleet).instance_id == "i1"
