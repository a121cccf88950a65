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
  wait    with no room anywhere: sheddable is refused at once (429); batch waits while fewer
          than `batch_max_queue` batch requests wait (else 429); the others wait, up to
          `max_queue` (a full queue refuses its newest lower waiter to make room, else the
          newcomer). Waiters are placed by class, then in arrival order, whenever room appears
          (a request ends, an instance arrives): an interactive request never waits behind a
          batch one. One not placed within `queue_timeout_s` gets 503 (while instances
          start, within `start_wait_s`: start_wait.py). Refusals carry Retry-After and take
          no I/O (well under 5 ms).

With `hold_without_instances` (an autoscaler may start the first instance), requests wait while
no instance serves their model; otherwise such a request goes on, and the proxy answers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.responses import Response

from strata.clock import Clock
from strata.errors import OverloadedError
from strata.gateway.config import AdmissionConfig, ClassConfig
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.path.start_wait import WaitBound, starting_instances
from strata.gateway.routing.instances import InstanceSet, InstanceView
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.upstream.pools import RelayResponse, error_response
from strata.gateway.upstream.proxy import ProxyRequest
from strata.types import PriorityClass

CLASSES = sorted(PriorityClass, reverse=True)  # highest first


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request was let in: its pool ("" when nothing constrains it) and class."""

    pool: str
    klass: PriorityClass


@dataclass(eq=False, slots=True)
class _Waiter:
    route: RouteRequest
    klass: PriorityClass
    future: asyncio.Future[Placement]


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
        self.num_shed = dict.fromkeys(CLASSES, 0)
        self._waiters: dict[PriorityClass, deque[_Waiter]] = {k: deque() for k in CLASSES}
        self._pump_task: asyncio.Task[None] | None = None
        self.clock = clock
        self.bound = WaitBound(admission.queue_timeout_s, admission.start_wait_s,
                               [starting_instances(instances)])  # an autoscaler adds its own

    def num_queued(self, klass: PriorityClass | None = None) -> int:
        if klass is not None:
            return len(self._waiters[klass])
        return sum(len(w) for w in self._waiters.values())

    def num_queued_for(self, pool: str) -> int:
        """Requests waiting whose class lives in `pool` (module docstring: pools)."""
        named = set(self.home.values())
        return sum(len(w) for k, w in self._waiters.items()
                   if self.home.get(k) == pool or (k not in self.home and pool not in named))

    async def acquire(self, route: RouteRequest) -> Placement:
        """A placement (release it when the answer is sent); OverloadedError 429/503."""
        klass = PriorityClass.of(route.priority)
        if not any(self._waiters[k] for k in CLASSES if k >= klass):
            placement = self._place(route, klass)
            if placement is not None:
                return self._take(placement)
        self._make_queue_room(klass)
        return await self._wait(route, klass)

    def release(self, placement: Placement) -> None:
        if placement.pool:
            self.in_flight[(placement.pool, placement.klass)] -= 1
        self._pump()

    # --- where a request may go ---------------------------------------------------------------

    def _place(self, route: RouteRequest, klass: PriorityClass) -> Placement | None:
        views = [v for v in self.instances.snapshot()
                 if v.is_routable and (route.model is None or v.model == route.model)]
        if not views:
            return None if self.config.hold_without_instances else Placement("", klass)
        home, spill = self._pools(route, klass, {v.pool for v in views})
        for pools in (home, spill):
            rooms = {pool: self._room(views, pool, klass) for pool in sorted(pools)}
            best = max(rooms, key=lambda p: rooms[p], default=None)
            if best is not None and rooms[best] >= 1:
                return Placement(best, klass)
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

    # --- waiting --------------------------------------------------------------------------------

    def _make_queue_room(self, klass: PriorityClass) -> None:
        if klass is PriorityClass.SHEDDABLE:
            raise self._shed(klass, "no pool has room for sheddable requests")
        if klass is PriorityClass.BATCH and \
                len(self._waiters[klass]) >= self.admission.batch_max_queue:
            raise self._shed(klass, f"{self.admission.batch_max_queue} batch requests already "
                                    "wait for room")
        if self.num_queued() < self.admission.max_queue:
            return
        for lower in reversed(CLASSES):
            if lower >= klass:
                break
            if self._waiters[lower]:
                waiter = self._waiters[lower].pop()
                waiter.future.set_exception(self._shed(
                    lower, f"a {klass.label} request took its place in the full queue"))
                return
        raise self._shed(klass, f"the gateway queue is full ({self.admission.max_queue} wait)")

    def _shed(self, klass: PriorityClass, why: str) -> OverloadedError:
        self.num_shed[klass] += 1
        return OverloadedError(f"{why}; retry later", status_code=429,
                               retry_after_s=self.admission.retry_after_s)

    async def _wait(self, route: RouteRequest, klass: PriorityClass) -> Placement:
        waiter = _Waiter(route, klass, asyncio.get_running_loop().create_future())
        self._waiters[klass].append(waiter)
        self._start_pump()
        began = self.clock()
        try:
            while (remaining := self.bound.remaining_s(self.clock() - began)) > 0:
                with contextlib.suppress(TimeoutError):  # looks at the bound again
                    return await asyncio.wait_for(asyncio.shield(waiter.future),
                                                  min(remaining, 10 * self.config.recheck_s))
            if self._granted(waiter):
                return waiter.future.result()
            raise OverloadedError(f"no pool had room for {self.bound.limit_s():g}s; "
                                  "retry later", status_code=503,
                                  retry_after_s=self.admission.retry_after_s) from None
        except asyncio.CancelledError:
            if self._granted(waiter):
                self.release(waiter.future.result())
            raise

    def _granted(self, waiter: _Waiter) -> bool:
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            return True
        future.cancel()
        if waiter in self._waiters[waiter.klass]:
            self._waiters[waiter.klass].remove(waiter)
        return False

    def _pump(self) -> None:
        """Place waiters, highest class first, oldest first within a class, while room lasts."""
        for klass in CLASSES:
            for waiter in list(self._waiters[klass]):
                placement = self._place(waiter.route, klass)
                if placement is not None and not waiter.future.done():
                    self._waiters[klass].remove(waiter)
                    waiter.future.set_result(self._take(placement))

    def _start_pump(self) -> None:
        """While requests wait, look for room every `recheck_s` (instances arrive, loads
        drop); releases place waiters at once."""
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump_while_waiting())

    async def _pump_while_waiting(self) -> None:
        while self.num_queued():
            await asyncio.sleep(self.config.recheck_s)
            self._pump()

    async def close(self) -> None:
        if self._pump_task is not None:
            self._pump_task.cancel()


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
