"""Priority classes at the gateway: class -> pool routing with spill-over, flow control by class,
shedding at saturation. `RouteByClass` is the outermost step of forward.py when it is on.

Classes, highest first: interactive, standard, batch, sheddable (strata.types.PriorityClass of
`RouteRequest.priority`, already clamped to the API key's ceiling). For each request:

  pools   `--class-pool CLASS=POOL` names a class's home pool; a class without one lives in the
          pools no class names (every pool, if all are named); `X-Strata-Pool` names one pool
          outright. A request may spill to another pool only while that pool has room for it.
  room    a pool takes at most `instance_slots` requests per routable instance of the request's
          model (0: no cap, as long as it has an instance). A request of one class counts only
          the requests of its class and above: lower ones are the engine's to preempt
          (strata/engine/priority.py), so an interactive request finds room in a pool full of
          batch work, and batch work fills only what the classes above leave.
  wait    with no room anywhere, the request waits in the gateway's one class-aware queue
          (class_queue.py: sheddable refused at once, batch capped at `batch_max_queue`, a
          full queue refuses its newest lower waiter; placed by class, then in arrival order,
          whenever room appears: a request ends, an instance arrives). One not placed within
          `queue_timeout_s` gets 503 (while instances start, within `start_wait_s`:
          start_wait.py). Refusals carry Retry-After and take no I/O.

With `hold_without_instances` (an autoscaler may start the first instance), requests wait while
no instance serves their model; otherwise such a request goes on, and the proxy answers it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.responses import Response

from strata import tracing
from strata.clock import Clock
from strata.errors import OverloadedError
from strata.gateway.config import AdmissionConfig, ClassConfig
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.path.class_queue import CLASSES, ClassQueue, Wording
from strata.gateway.path.start_wait import WaitBound, starting_instances
from strata.gateway.routing.instances import InstanceSet, InstanceView
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.upstream.pools import RelayResponse, error_response
from strata.gateway.upstream.proxy import ProxyRequest
from strata.types import PriorityClass

WORDING = Wording(no_room="no pool has room", timed_out="no pool had room for {limit_s:g}s")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request was let in: its pool ("" when nothing constrains it) and class."""

    pool: str
    klass: PriorityClass


class ClassFlow:
    """Places requests in pools by class and holds the ones that find no room."""

    def __init__(self, config: ClassConfig, admission: AdmissionConfig,
                 instances: InstanceSet, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.admission = admission
        self.instances = instances
        self.home = {PriorityClass[label.upper()]: pool for label, pool in config.class_pools}
        self.in_flight: dict[tuple[str, PriorityClass], int] = {}
        self.num_placed: dict[str, int] = {}  # pool -> requests placed there (the autoscaler's)
        self.clock = clock
        self.bound = WaitBound(admission.queue_timeout_s, admission.start_wait_s,
                               [starting_instances(instances)])  # an autoscaler adds its own
        self.queue: ClassQueue[Placement] = ClassQueue(
            self._place, self.release, admission, self.bound, WORDING, clock=clock,
            recheck_s=config.recheck_s)

    @property
    def num_shed(self) -> dict[PriorityClass, int]:
        return self.queue.num_shed

    def num_queued(self, klass: PriorityClass | None = None) -> int:
        return self.queue.num_queued(klass)

    def num_queued_for(self, pool: str) -> int:
        """Requests waiting whose class lives in `pool` (module docstring: pools)."""
        named = set(self.home.values())
        return sum(self.queue.num_queued(k) for k in self.queue.waiting_classes()
                   if self.home.get(k) == pool or (k not in self.home and pool not in named))

    async def acquire(self, route: RouteRequest) -> Placement:
        """A placement (release it when the answer is sent); OverloadedError 429/503."""
        return await self.queue.acquire(route)

    def release(self, placement: Placement) -> None:
        if placement.pool:
            self.in_flight[(placement.pool, placement.klass)] -= 1
        self.queue.pump()

    def _place(self, route: RouteRequest, klass: PriorityClass) -> Placement | None:
        """The room rule: a pool with room for `klass` (taken), or None."""
        views = [v for v in self.instances.snapshot()
                 if v.is_routable and (route.model is None or v.model == route.model)]
        if not views:
            return None if self.config.hold_without_instances else Placement("", klass)
        home, spill = self._pools(route, klass, {v.pool for v in views})
        for pools in (home, spill):
            rooms = {pool: self._room(views, pool, klass) for pool in sorted(pools)}
            best = max(rooms, key=lambda p: rooms[p], default=None)
            if best is not None and rooms[best] >= 1:
                return self._take(Placement(best, klass))
        return None

    def _pools(self, route: RouteRequest, klass: PriorityClass,
               present: set[str]) -> tuple[set[str], set[str]]:
        """(home pools, pools it may spill to) of a request."""
        if route.pool is not None:
            return {route.pool}, set()
        if klass in self.home:
            home = {self.home[klass]}
        else:
            home = (present - set(self.home.values())) or present
        return home, present - home

    def _room(self, views: list[InstanceView], pool: str, klass: PriorityClass) -> float:
        num_instances = sum(1 for v in views if v.pool == pool)
        if num_instances == 0:
            return 0.0
        capacity = num_instances * self.config.instance_slots or math.inf
        return capacity - sum(self.in_flight.get((pool, k), 0) for k in CLASSES if k >= klass)

    def _take(self, placement: Placement) -> Placement:
        if placement.pool:
            key = (placement.pool, placement.klass)
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
            self.num_placed[placement.pool] = self.num_placed.get(placement.pool, 0) + 1
        return placement

    async def close(self) -> None:
        await self.queue.close()


class ClassMetrics(Collector):
    """`strata:gateway_class_*`: requests queued, in flight and shed, by class (and pool)."""

    def __init__(self, flow: ClassFlow) -> None:
        self.flow = flow

    def collect(self) -> Iterator[GaugeMetricFamily]:
        queued = GaugeMetricFamily("strata:gateway_class_queued",
                                   "Requests waiting for room, by class.", labels=["class"])
        shed = GaugeMetricFamily("strata:gateway_class_shed",
                                 "Requests refused for lack of room since start, by class.",
                                 labels=["class"])
        in_flight = GaugeMetricFamily("strata:gateway_class_in_flight",
                                      "Requests placed in a pool, by pool and class.",
                                      labels=["pool", "class"])
        for klass in CLASSES:
            queued.add_metric([klass.label], self.flow.num_queued(klass))
            shed.add_metric([klass.label], self.flow.num_shed[klass])
        for (pool, klass), count in sorted(self.flow.in_flight.items()):
            in_flight.add_metric([pool, klass.label], count)
        yield from (queued, shed, in_flight)


Handler = Callable[[ProxyRequest], Awaitable[Response]]


class RouteByClass:
    """Places the request by class (ClassFlow) and holds its place until the answer is fully
    sent; a refusal is answered at once, 429 or 503 with Retry-After."""

    def __init__(self, flow: ClassFlow, metrics: GatewayMetrics) -> None:
        self.flow = flow
        self.metrics = metrics
        metrics.registry.register(ClassMetrics(flow))

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        try:
            placement = await self.flow.acquire(request.route)
        except OverloadedError as exc:
            self.metrics.errors.labels(f"class_{exc.status_code}").inc()
            return error_response(exc.status_code, exc.message, retry_after_s=exc.retry_after_s)
        if placement.pool:
            route = dataclasses.replace(request.route, pool=placement.pool)
            request = dataclasses.replace(request, route=route)
        if tracing.is_on():
            tracing.note({"strata.priority": request.route.priority,
                          "strata.class.pool": placement.pool or None})
        try:
            response = await call_next(request)
        except BaseException:
            self.flow.release(placement)
            raise
        if isinstance(response, RelayResponse):
            response.on_close.append(lambda: self.flow.release(placement))
        else:
            self.flow.release(placement)
        return response


__all__ = ["ClassFlow", "ClassMetrics", "Placement", "RouteByClass"]
