"""Consistent hashing with bounded loads: property tests over the pure functions and over the
gateway's session router (pins in a memory store).

Tolerances stated here: adding one instance to N re-placing every session from scratch (the pure
ring, epsilon >= 0.25, >= 1000 sessions) moves at most 1/(N+1) + 0.05 of them; with pins (what
sticky routing does) a session moves only off an instance over the new bound, so at most
1/(N+1), and removing an instance moves exactly its sessions. Hypothesis runs derandomized (the
same examples every run), so CI never flakes on a rare seed.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter

from gateway_fakes import FakeClock, view
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.gateway.config import SessionRoutingConfig
from strata.gateway.path.sessions import SessionRouter
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies import create_policy
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.routing.policies.consistent_hash import (
    HashRing,
    RingCache,
    bounded_capacity,
    place,
    stable_hash,
)
from strata.state.pins import MemoryPinStore

EPSILONS = st.sampled_from([0.25, 0.5, 1.0])


def ids(num: int) -> list[str]:
    return [f"inst-{i}" for i in range(num)]


def zipf_requests(num_sessions: int, num_requests: int, exponent: float,
                  seed: int) -> list[str]:
    """Session ids of a request stream whose session popularity follows Zipf(exponent)."""
    rng = random.Random(seed)
    sessions = [f"user-{rng.getrandbits(48):x}" for _ in range(num_sessions)]
    weights = [1.0 / (rank + 1) ** exponent for rank in range(num_sessions)]
    return rng.choices(sessions, weights=weights, k=num_requests)


def fill(members: list[str], keys: list[str], epsilon: float) -> dict[str, str]:
    """Every distinct key placed once, in order, with bounded loads."""
    ring, loads, where = HashRing.build(members), Counter[str](), {}
    for key in dict.fromkeys(keys):
        where[key] = place(ring, key, loads, epsilon=epsilon)
        loads[where[key]] += 1
    return where


@settings(max_examples=40, deadline=None, derandomize=True)
@given(num_instances=st.integers(2, 12), epsilon=EPSILONS | st.just(0.1),
       exponent=st.floats(1.05, 2.0), seed=st.integers(0, 2**32))
def test_zipf_skewed_sessions_never_exceed_the_bound(num_instances: int, epsilon: float,
                                                     exponent: float, seed: int) -> None:
    ring, loads = HashRing.build(ids(num_instances)), Counter[str]()
    placed: set[str] = set()
    for key in zipf_requests(800, 3000, exponent, seed):
        if key in placed:
            continue  # later requests of a placed session hit its pin
        loads[place(ring, key, loads, epsilon=epsilon)] += 1
        placed.add(key)
        bound = math.ceil((1 + epsilon) * len(placed) / num_instances)
        assert max(loads.values()) <= bound


@settings(max_examples=25, deadline=None, derandomize=True)
@given(num_instances=st.integers(2, 12), epsilon=EPSILONS, seed=st.integers(0, 2**32))
def test_adding_an_instance_moves_about_one_over_n_plus_one(num_instances: int, epsilon: float,
                                                            seed: int) -> None:
    keys = zipf_requests(1200, 1200, 0.0, seed)  # 1200 draws over 1200 ids: ~760 distinct
    keys = list(dict.fromkeys(keys + [f"extra-{seed}-{i}" for i in range(600)]))
    assert len(keys) >= 1000
    before = fill(ids(num_instances), keys, epsilon)
    after = fill(ids(num_instances) + ["inst-new"], keys, epsilon)
    moved = sum(before[k] != after[k] for k in keys) / len(keys)
    assert moved <= 1 / (num_instances + 1) + 0.05


def test_without_bounds_removing_an_instance_moves_only_its_keys() -> None:
    keys = [f"k{i}" for i in range(2000)]
    big = 10.0**9  # an epsilon so large that no bound ever binds: the plain ring
    before = fill(ids(5), keys, big)
    after = fill(ids(4), keys, big)  # inst-4 left
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys
                                                          if before[k] == "inst-4"}


def test_placement_is_deterministic_and_never_uses_the_salted_builtin_hash() -> None:
    assert stable_hash("session-1") == int.from_bytes(
        bytes.fromhex("ae49bd2cd463e7ac"), "big")  # blake2b-64: the same in every process
    shuffled = ids(6)
    random.Random(7).shuffle(shuffled)
    assert HashRing.build(ids(6)) == HashRing.build(shuffled)
    assert len(HashRing.build(ids(6)).points) == 600  # 100 virtual nodes each
    keys = [f"s{i}" for i in range(300)]
    assert fill(ids(6), keys, 0.25) == fill(shuffled, keys, 0.25)
    assert bounded_capacity(10, 4, 0.25) == 4  # ceil(3.125)


def test_the_ring_is_rebuilt_only_when_an_instance_joins() -> None:
    cache = RingCache()
    first = cache.ring_for(["a", "b", "c"])
    assert cache.ring_for(["a", "c"]) is first  # a subset (one left or excluded) reuses it
    assert cache.ring_for(["c", "b", "a"]) is first
    assert cache.ring_for(["a", "b", "c", "d"]) is not first
    assert cache.num_builds == 2


def test_the_consistent_hash_policy_keeps_a_session_and_spreads_the_rest() -> None:
    policy = create_policy("consistent_hash")
    views = [view("a"), view("b"), view("c")]
    chosen = {policy.choose(RouteRequest(session_id="chat-9"), views).instance_id
              for _ in range(5)}
    assert len(chosen) == 1
    busy = next(v for v in views if v.instance_id in chosen)
    busy.num_in_flight = 50  # far over ceil(1.25 * mean in flight): the session spills over
    assert policy.choose(RouteRequest(session_id="chat-9"), views) is not busy
    views[0].num_in_flight, views[1].num_in_flight, views[2].num_in_flight = 3, 1, 2
    assert policy.choose(RouteRequest(), views).instance_id == "b"  # no session: least load


# --- with pins: what sticky routing does --------------------------------------------------------

def router() -> SessionRouter:
    config = SessionRoutingConfig(mode="sticky", counts_max_age_s=10.0**9)
    return SessionRouter(config, MemoryPinStore(), clock=FakeClock())


async def turns(sessions: SessionRouter, keys: list[str],
                views: list[InstanceView]) -> dict[str, str]:
    """One turn of every session, in order: where each went."""
    where = {}
    for key in keys:
        placement = await sessions.place(key, views)
        assert placement.instance_id is not None
        where[key] = placement.instance_id
    return where


@settings(max_examples=12, deadline=None, derandomize=True)
@given(num_instances=st.integers(2, 10), seed=st.integers(0, 2**32))
def test_with_pins_scale_up_moves_at_most_one_over_n_plus_one_and_scale_down_only_the_leavers(
        num_instances: int, seed: int) -> None:
    keys = [f"s{seed}-{i}" for i in range(1000)]
    views = [view(i) for i in ids(num_instances)]

    async def story() -> None:
        sessions = router()
        before = await turns(sessions, keys, views)
        grown = await turns(sessions, keys, [*views, view("inst-new")])
        moved = [k for k in keys if before[k] != grown[k]]
        assert len(moved) <= len(keys) / (num_instances + 1)
        bound = bounded_capacity(len(keys), num_instances + 1, 0.25)
        assert max(Counter(grown.values()).values()) <= bound
        shrunk = await turns(sessions, keys, [*views[1:], view("inst-new")])  # inst-0 leaves
        assert {k for k in keys if grown[k] != shrunk[k]} == {
            k for k in keys if grown[k] == "inst-0"}

    asyncio.run(story())
