"""Load averages over one request duration, on an injected clock: the window is measured, the
average follows the held load exponentially, and the bound it gives lets a tenant's home take a
request above the instantaneous cap while its load averaged over time is under the mean's
bound."""

from __future__ import annotations

import math

import pytest

from strata.clock import ManualClock
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies import CacheAwarePolicy
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.routing.policies.load_average import LoadAverages
from strata.gateway.routing.prefix.index import BlockBatch, PrefixIndex
from strata.gateway.routing.prefix.prompt import KeySet, PrefixKeys

PREFIX = tuple(bytes([i]) * 16 for i in range(60))  # a 960-token system prompt


def views(n: int) -> list[InstanceView]:
    return [InstanceView(f"i{k}", f"http://i{k}", "m") for k in range(n)]


def request(ids: list[str]) -> RouteRequest:
    keyset = KeySet(PREFIX, 16, len(PREFIX) * 16 + 40)
    return RouteRequest(model="m", num_tokens=1200,
                        prefix=PrefixKeys(dict.fromkeys(ids, keyset), 32))


def test_no_average_and_no_relaxation_before_a_request_has_finished() -> None:
    clock = ManualClock()
    averages = LoadAverages(clock)
    fleet = views(2)
    averages.routed(1, "i0")
    clock.advance(5.0)
    assert averages.window_s is None
    assert averages.average("i0") == 0.0
    assert averages.under_bound(fleet, 0.25) == set()


def test_the_window_is_the_mean_duration_and_the_average_follows_the_held_load() -> None:
    clock = ManualClock()
    averages = LoadAverages(clock)
    averages.routed(1, "i0")
    averages.routed(2, "i1")
    clock.advance(2.0)
    averages.finished(1, "i0")  # lasted 2 s: the window
    assert averages.window_s == 2.0
    averages.routed(3, "i0")
    clock.advance(1.0)
    averages.finished(2, "i1")  # lasted 3 s: the window is now 2.5 s
    assert averages.window_s == 2.5
    # i0 held 1 request and i1 1 request for the 1 s at the 2 s window, from averages of 0
    assert averages.average("i0") == pytest.approx(1 - math.exp(-1 / 2))
    clock.advance(2.5)  # i1 now holds nothing, i0 still one: one window later
    held = 1 - math.exp(-1 / 2)
    assert averages.average("i1") == pytest.approx(held * math.exp(-1))
    assert averages.average("i0") == pytest.approx(held + (1 - held) * (1 - math.exp(-1)))


def test_the_bound_is_epsilon_over_the_mean_of_the_averages() -> None:
    clock = ManualClock()
    averages = LoadAverages(clock)
    fleet = views(4)
    for k, iid in enumerate(["i0", "i0", "i0", "i1", "i2"]):
        averages.routed(k, iid)
    averages.routed(99, "i3")
    clock.advance(1.0)
    averages.finished(99, "i3")  # window 1 s; held loads 3, 1, 1, 1 for that second
    clock.advance(100.0)  # long past the window: the averages are the held loads 3, 1, 1, 0
    assert [round(averages.average(v.instance_id), 6) for v in fleet] == [3, 1, 1, 0]
    assert averages.under_bound(fleet, 0.25) == {"i1", "i2", "i3"}  # bound 1.25 * 5 / 4
    assert averages.under_bound(fleet, 2.0) == {"i0", "i1", "i2", "i3"}  # bound 3.75


def test_a_home_over_the_instant_cap_keeps_its_prefix_while_its_average_is_under_the_bound(
        ) -> None:
    clock = ManualClock()
    policy = CacheAwarePolicy(PrefixIndex(clock=clock), epsilon=0.25)
    fleet = views(2)
    policy.index.apply("i0", BlockBatch(0.0, 1, list(PREFIX), is_snapshot=True))
    background = [RouteRequest(num_tokens=10) for _ in range(3)]
    policy.on_request_routed(background[0], fleet[0])
    clock.advance(1.0)
    policy.on_request_finished(background[0], fleet[0], is_success=True)  # the window: 1 s
    route(policy, background[1], fleet[0])
    route(policy, background[2], fleet[1])
    clock.advance(10.0)  # ten windows of one request at each: both averages ~1
    policy.on_request_finished(background[2], fleet[1], is_success=True)  # window 5.5 s
    fleet[1].num_in_flight = 0
    for _ in range(2):  # a burst of the tenant at its home: 3 in flight there, 0 at i1
        route(policy, request(ids=["i0", "i1"]), fleet[0])
    assert math.ceil(1.25 * (3 + 1) / 2) == 3  # the instantaneous cap: i0 is over it
    assert policy.averages.under_bound(fleet, 0.25) == {"i0", "i1"}  # ~1 each, bound 1.25
    assert policy.choose(request(ids=["i0", "i1"]), fleet).instance_id == "i0"
    clock.advance(5 * 5.5)  # the burst lasts five windows: the average catches up with it
    assert policy.averages.average("i0") == pytest.approx(3.0, abs=0.02)
    assert policy.averages.under_bound(fleet, 0.25) == {"i1"}  # bound 1.25 * 1.5
    assert policy.choose(request(ids=["i0", "i1"]), fleet).instance_id == "i1"


def route(policy: CacheAwarePolicy, req: RouteRequest, view: InstanceView) -> None:
    """As the proxy: the view counts the request, then the policy's hook learns it."""
    view.num_in_flight += 1
    policy.on_request_routed(req, view)


def test_an_instance_idle_for_many_windows_is_forgotten() -> None:
    """Memory stays bounded by the instances with recent traffic: one that left (no request in
    flight, its average decayed to nothing) has no entry left once another event advances."""
    clock = ManualClock()
    averages = LoadAverages(clock)
    averages.routed(1, "a")
    clock.advance(1.0)
    averages.finished(1, "a")  # the window: 1 s
    averages.routed(2, "gone")
    clock.advance(1.0)
    averages.routed(3, "kept")
    averages.finished(2, "gone")
    assert averages.average("gone") > 0.5
    clock.advance(30.0)  # 30 windows: e^-30 of a request is left
    averages.routed(3, "kept")
    assert "gone" not in averages._average and "gone" not in averages._load
    assert averages.average("gone") == 0.0
    assert averages.average("kept") == pytest.approx(1.0, abs=1e-6)
