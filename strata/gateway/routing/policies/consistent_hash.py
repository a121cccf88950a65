"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

Each instance owns `num_vnodes` points on a 64-bit ring (blake2b of "instance#i"; never Python's
salted `hash()`, so every gateway process builds the same ring). A key hashes onto the ring and
walks clockwise to the first instance whose load is under the capacity

    capacity = ceil((1 + epsilon) * total / num_instances)

where `total` counts the key being placed. Because the capacities sum to more than `total`, the
walk always ends at an instance, and no instance ever holds more than the capacity.

Everything here is a pure function over a snapshot: a `HashRing` is immutable and rebuilt only
when the membership changes (`RingCache`). `ConsistentHashPolicy` is the routing policy
`consistent_hash`: requests with a session id are placed by their session id with the gateway's
in-flight requests as the load; requests without one go to the least loaded candidate.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies.base import RouteRequest, StatelessPolicy

DEFAULT_NUM_VNODES = 100
DEFAULT_EPSILON = 0.25


def stable_hash(key: str) -> int:
    """A 64-bit hash of `key`, the same in every process and on every machine."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def bounded_capacity(total: int, num_instances: int, epsilon: float) -> int:
    """ceil((1 + epsilon) * total / num_instances): the most one instance may hold."""
    if num_instances <= 0:
        raise ValueError("bounded_capacity needs at least one instance")
    return math.ceil((1.0 + epsilon) * total / num_instances)


@dataclass(frozen=True, slots=True)
class HashRing:
    """Sorted ring points and the instance owning each; `members` are the instance ids."""

    points: tuple[int, ...]
    owners: tuple[str, ...]
    members: frozenset[str]

    @classmethod
    def build(cls, instance_ids: Iterable[str], num_vnodes: int = DEFAULT_NUM_VNODES) -> HashRing:
        if num_vnodes <= 0:
            raise ConfigError(f"num_vnodes must be positive, got {num_vnodes}")
        members = frozenset(instance_ids)
        ring = sorted((stable_hash(f"{iid}#{i}"), iid) for iid in members
                      for i in range(num_vnodes))
        return cls(tuple(p for p, _ in ring), tuple(o for _, o in ring), members)

    def walk(self, key: str) -> Iterator[str]:
        """Distinct instance ids clockwise from `key`'s point, each once."""
        start = bisect.bisect_left(self.points, stable_hash(key))
        seen: set[str] = set()
        num_points = len(self.points)
        for offset in range(num_points):
            owner = self.owners[(start + offset) % num_points]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.members):
                    return


def place(ring: HashRing, key: str, loads: Mapping[str, int], *, epsilon: float,
          allowed: Collection[str] | None = None, total: int | None = None) -> str:
    """The first instance clockwise from `key` whose load is under the bounded capacity.

    `loads` counts what the instances already hold (not `key`); only `allowed` instances (all
    ring members by default) are eligible. The mean is `total` (default: the eligible instances'
    loads) plus `key`, over the eligible instances; a larger `total` counts keys that will come
    to them (those held by instances that left)."""
    eligible = ring.members if allowed is None else ring.members & frozenset(allowed)
    if not eligible:
        raise ValueError("place needs at least one eligible instance")
    held = sum(loads.get(iid, 0) for iid in eligible) if total is None else total
    capacity = bounded_capacity(held + 1, len(eligible), epsilon)
    for instance_id in ring.walk(key):
        if instance_id in eligible and loads.get(instance_id, 0) < capacity:
            return instance_id
    raise AssertionError("bounded capacity invariant broken: every instance is full")


def is_over_bound(instance_id: str, loads: Mapping[str, int], eligible: Collection[str], *,
                  epsilon: float, total: int | None = None) -> bool:
    """Whether `instance_id` holds more than the capacity; `loads` (and `total`, default the
    eligible instances' loads) already count every key."""
    held = sum(loads.get(iid, 0) for iid in eligible) if total is None else total
    return loads.get(instance_id, 0) > bounded_capacity(held, len(eligible), epsilon)


class RingCache:
    """The ring over the current membership: rebuilt only when an instance joins. A subset of
    the members (instances that left, or were excluded for one request) reuses the ring: walking
    it and skipping non-members gives the same order as a ring built over the subset."""

    def __init__(self, num_vnodes: int = DEFAULT_NUM_VNODES) -> None:
        self.num_vnodes = num_vnodes
        self.ring = HashRing.build((), num_vnodes)
        self.num_builds = 0

    def ring_for(self, instance_ids: Collection[str]) -> HashRing:
        if not frozenset(instance_ids) <= self.ring.members:
            self.ring = HashRing.build(instance_ids, self.num_vnodes)
            self.num_builds += 1
        return self.ring


class ConsistentHashPolicy(StatelessPolicy):
    """`consistent_hash`: a session's requests go to one instance while its in-flight load is
    under ceil((1+epsilon) * mean); requests without a session go to the least loaded."""

    name = "consistent_hash"

    def __init__(self, *, epsilon: float = DEFAULT_EPSILON,
                 num_vnodes: int = DEFAULT_NUM_VNODES) -> None:
        if epsilon <= 0:
            raise ConfigError(f"epsilon must be positive, got {epsilon}")
        self.epsilon = epsilon
        self.rings = RingCache(num_vnodes)

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        if request.session_id is None:
            return min(candidates, key=lambda view: view.load_key)
        by_id = {view.instance_id: view for view in candidates}
        loads = {iid: view.request_load for iid, view in by_id.items()}
        ring = self.rings.ring_for(by_id)
        return by_id[place(ring, request.session_id, loads, epsilon=self.epsilon,
                           allowed=by_id)]


__all__ = ["DEFAULT_EPSILON", "DEFAULT_NUM_VNODES", "ConsistentHashPolicy", "HashRing",
           "RingCache", "bounded_capacity", "is_over_bound", "place", "stable_hash"]
