"""Routing policies over fake instances: exact picks."""

from __future__ import annotations

import random

import pytest
from gateway_fakes import view

from strata.errors import ConfigError
from strata.gateway.routing.policies import (
    LeastLoadPolicy,
    PowerOfTwoPolicy,
    RoundRobinPolicy,
    RouteRequest,
    create_policy,
)

REQ = RouteRequest(model="m")


def test_round_robin_goes_round_in_id_order_and_advances_only_when_routed() -> None:
    candidates = [view("a"), view("b"), view("c")]
    policy = RoundRobinPolicy()
    picks = []
    for _ in range(5):
        chosen = policy.choose(REQ, candidates)
        assert policy.choose(REQ, candidates) is chosen  # choosing twice changes nothing
        policy.on_request_routed(REQ, chosen)
        picks.append(chosen.instance_id)
    assert picks == ["a", "b", "c", "a", "b"]


def test_least_load_counts_own_in_flight_and_reported_load_without_double_counting() -> None:
    busy_reported = view("a", running=3, waiting=2)  # load 5 (reported)
    busy_here = view("b", num_in_flight=4, running=1)  # load 4 (our own count is larger)
    light = view("c", running=1, waiting=1, num_in_flight=1)  # load 2
    assert LeastLoadPolicy().choose(REQ, [busy_reported, busy_here, light]) is light


def test_least_load_breaks_request_ties_by_tokens_then_by_id() -> None:
    a = view("a", num_in_flight=1, num_in_flight_tokens=900)
    b = view("b", num_in_flight=1, num_in_flight_tokens=100)
    c = view("c", num_in_flight=1, num_in_flight_tokens=100)
    assert LeastLoadPolicy().choose(REQ, [a, b, c]) is b


def test_power_of_two_takes_the_less_loaded_of_the_two_sampled() -> None:
    candidates = [view("a", running=9), view("b", running=1), view("c", running=5),
                  view("d", running=0)]
    seed = 7
    sampled = random.Random(seed).sample(candidates, 2)
    expected = min(sampled, key=lambda v: v.load_key)
    chosen = PowerOfTwoPolicy(random.Random(seed)).choose(REQ, candidates)
    assert chosen is expected


def test_power_of_two_never_picks_the_most_loaded_of_three() -> None:
    candidates = [view("a", running=1), view("b", running=2), view("c", running=9)]
    policy = PowerOfTwoPolicy(random.Random(0))
    picks = {policy.choose(REQ, candidates).instance_id for _ in range(200)}
    assert picks == {"a", "b"}


def test_power_of_two_with_one_candidate_takes_it() -> None:
    only = view("a")
    assert PowerOfTwoPolicy(random.Random(0)).choose(REQ, [only]) is only


def test_factory_builds_each_policy_and_lists_valid_names_on_error() -> None:
    assert isinstance(create_policy("round_robin"), RoundRobinPolicy)
    assert isinstance(create_policy("least_load"), LeastLoadPolicy)
    assert isinstance(create_policy("power_of_two", rng=random.Random(1)), PowerOfTwoPolicy)
    with pytest.raises(ConfigError, match="least_load, power_of_two, round_robin"):
        create_policy("random")
