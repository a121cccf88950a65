"""How long a request may wait at the gateway: `queue_timeout_s`, or, while capacity is on its
way, as long as an instance takes to start (`start_wait_s`, `--start-wait-s`).

Capacity is on its way while an instance of the fleet is STARTING (registered, loading) or an
attached autoscaler has decided on more replicas than are ready (its new instances are still
processes importing, not yet registered). Without that, a request that arrives while the fleet
is at zero, or at a load step, would get 503 after `queue_timeout_s` although the instance that
would serve it is seconds away; with it, it is served when that instance is ready. A fleet that
never gets there still answers 503, after `start_wait_s`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from strata.gateway.routing.instances import STARTING, InstanceSet

CapacitySign = Callable[[], bool]


@dataclass(slots=True)
class WaitBound:
    """The deadline of one waiter, from the time it began to wait."""

    queue_timeout_s: float
    start_wait_s: float
    signs: list[CapacitySign] = field(default_factory=list)

    @property
    def is_capacity_coming(self) -> bool:
        return any(sign() for sign in self.signs)

    def limit_s(self) -> float:
        """The wait allowed now: the start wait while capacity comes, else the queue timeout."""
        if self.is_capacity_coming:
            return max(self.queue_timeout_s, self.start_wait_s)
        return self.queue_timeout_s

    def remaining_s(self, waited_s: float) -> float:
        return self.limit_s() - waited_s


def starting_instances(instances: InstanceSet) -> CapacitySign:
    """True while an instance of the set is registered and not yet ready."""
    def sign() -> bool:
        return any(v.state == STARTING for v in instances.snapshot())
    return sign


__all__ = ["CapacitySign", "WaitBound", "starting_instances"]
