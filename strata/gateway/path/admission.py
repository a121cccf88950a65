"""Admission control: a cap on requests in flight and a bounded queue, served by class.

A request past the cap waits in the queue of its priority class (strata.types.PriorityClass);
a released slot passes straight to the oldest waiter of the highest class, so the count in
flight never exceeds the cap and an interactive request never waits behind a batch one. The
queue is the gateway's one class-aware queue (class_queue.py: its shedding rules, its bound of
`queue_timeout_s`), with a free slot under `max_in_flight` as the room rule.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from strata.clock import Clock
from strata.gateway.config import AdmissionConfig
from strata.gateway.path.class_queue import ClassQueue, Wording
from strata.gateway.path.start_wait import WaitBound
from strata.gateway.routing.policies.base import RouteRequest
from strata.types import PriorityClass

WORDING = Wording(no_room="the gateway is full",
                  timed_out="waited {limit_s:g}s in the gateway queue")


class Admission:
    """Counts in-flight requests; `slot()` holds one for the duration of a request."""

    def __init__(self, config: AdmissionConfig, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.num_in_flight = 0
        self.queue: ClassQueue[bool] = ClassQueue(
            self._take, lambda _: self.release(), config,
            WaitBound(config.queue_timeout_s, config.queue_timeout_s), WORDING, clock=clock)

    @property
    def num_queued(self) -> int:
        return self.queue.num_queued()

    def num_queued_of(self, klass: PriorityClass) -> int:
        return self.queue.num_queued(klass)

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, priority: int = 0) -> None:
        """Takes a slot, waiting in the queue if needed; raises OverloadedError (429/503)."""
        await self.queue.acquire(RouteRequest(priority=priority))

    def _take(self, route: RouteRequest, klass: PriorityClass) -> bool | None:
        if self.num_in_flight >= self.config.max_in_flight:
            return None
        self.num_in_flight += 1
        return True

    def release(self) -> None:
        """Frees the slot; the oldest waiter of the highest class takes it."""
        self.num_in_flight -= 1
        self.queue.pump()


__all__ = ["Admission"]
