"""Outages shorter than a start are invisible: a request that found no instance alive waits for one.

When every attempt of a request failed without an answer from any instance (refused, reset,
timed out, silent), or no instance of its model was routable at all, and nothing has reached the
client yet, the whole fleet of that model may be restarting: a supervisor, Ray or Kubernetes
brings the processes back within seconds, and the registry or the health checks see them again.
Rather than answering 502 or 503 at once, the proxy waits (up to `start_wait_s`, the time an
instance takes to start) until an instance of the model passes a health check after the failure
(or is registered anew), then tries again, as if the request had just arrived.

"The fleet" is the instances that could take the request: those its route's filters keep
(model, role, pool; strata/gateway/routing/pipeline.py) whether or not they are routable now.
Another role's or pool's instance that is up (the prefill instance of a P/D fleet, a class's
own pool) cannot take it, so it does not make the request's fleet look alive. The version
counts only while it has instances that are not leaving: a request decided for v2 whose v2
instance is restarting or ejected waits for it even while v1's instances (retiring, or kept for
pinned sessions) are up, since they cannot take it. A version whose instances are all leaving
(a canary rolled back, a retired version) is not an outage while another version of the model
serves; waiting for it would hold the request until --start-wait-s.

It never waits for an answer that an instance gave: a 5xx or 429 answer means the instance is
alive, and the client gets that answer as before. A model no instance has ever served (404) is
not waited for either.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection

from strata.clock import Clock
from strata.gateway.routing.instances import DRAINING, InstanceSet, InstanceView
from strata.gateway.routing.pipeline import FILTERS, is_routable, serves_version
from strata.gateway.routing.policies.base import RouteRequest

Sleep = Callable[[float], Awaitable[None]]
_NOT_JUDGED = (is_routable, serves_version)  # the filters recovery does not judge a fleet by


class Recovery:
    """Waits for an instance of a model to come back (see the module docstring).

    `clock` is the health checks' clock (`InstanceView.healthy_at` is on it); the wait itself is
    bounded on the event loop's clock, so an injected clock that stands still never holds a
    request longer than `start_wait_s`."""

    def __init__(self, instances: InstanceSet, start_wait_s: float, *,
                 clock: Clock = time.monotonic, poll_s: float = 0.1,
                 sleep: Sleep = asyncio.sleep) -> None:
        self.instances = instances
        self.start_wait_s = start_wait_s
        self.clock = clock
        self.poll_s = poll_s
        self.sleep = sleep
        self.num_waits = 0  # requests that waited for an instance to come back
        self.num_recovered = 0  # of which one came back in time

    def _views(self, route: RouteRequest) -> list[InstanceView]:
        """The instances that could take `route` (routable now or not): of its version while
        that version has instances that are not leaving, else of any version."""
        views = [v for v in self.instances.snapshot()
                 if all(keep(route, v) for keep in FILTERS if keep not in _NOT_JUDGED)]
        staying = [v for v in views if serves_version(route, v) and not _is_leaving(v)]
        return staying if route.version is not None and staying else views

    def is_down(self, route: RouteRequest, tried: Collection[str]) -> bool:
        """Every known instance that could take `route` failed this request or looks down (not
        routable, or its last health check failed); False when none is known (a model nobody
        serves)."""
        views = self._views(route)
        return bool(views) and not any(v.instance_id not in tried and v.is_routable
                                       and v.is_healthy for v in views)

    def is_back(self, route: RouteRequest, since: float, known: Collection[str]) -> bool:
        """Some instance that could take `route` is routable and passed a health check after
        `since`, or is one not in `known` (registered since)."""
        return any(v.is_routable and (v.healthy_at > since or v.instance_id not in known)
                   for v in self._views(route))

    async def wait(self, route: RouteRequest, tried: Collection[str], until: float) -> bool:
        """When the request's fleet is down (`is_down`), wait until an instance is back (True)
        or the loop's clock reaches `until` (False); False at once when it is not down."""
        if not self.is_down(route, tried):
            return False
        since, known = self.clock(), {v.instance_id for v in self._views(route)}
        self.num_waits += 1
        loop = asyncio.get_running_loop()
        while loop.time() < until:
            await self.sleep(self.poll_s)
            if self.is_back(route, since, known):
                self.num_recovered += 1
                return True
        return False

    def deadline(self) -> float:
        """The loop time until which a request that finds its fleet down may wait."""
        return asyncio.get_running_loop().time() + self.start_wait_s


def _is_leaving(view: InstanceView) -> bool:
    return view.is_draining or view.state == DRAINING


__all__ = ["Recovery"]
