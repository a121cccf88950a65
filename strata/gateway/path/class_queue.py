"""One class-aware wait queue: per-class FIFOs, shedding to make room, wait, grant, cancel.

Both of the gateway's holds are this queue with their own room rule:

    admission   room = a free slot under `--max-in-flight` (admission.py)
    classes     room = a pool with room for the request's class (classes.py)

`acquire` takes room at once when the rule gives it and no request of the same class or above
waits (so nobody jumps ahead of its own class); otherwise the request waits in its class's FIFO.
Before it waits, the queue makes room for it: sheddable is refused at once (429); batch once
`batch_max_queue` batch requests wait (429); a full queue (`max_queue`) refuses its newest
waiter of a lower class, else the newcomer (429). `pump` grants room to waiters highest class
first, oldest first within a class, while the rule gives room: an interactive request never
waits behind a batch one. A waiter not granted within its bound (`WaitBound`: the queue timeout,
or the start wait while capacity is on its way) gets 503. A waiter cancelled (the client left)
leaves the queue; cancelled just after its grant, it hands the room back. Every refusal carries
Retry-After and takes no I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from strata.clock import Clock
from strata.errors import OverloadedError
from strata.gateway.config import AdmissionConfig
from strata.gateway.path.start_wait import WaitBound
from strata.gateway.routing.policies.base import RouteRequest
from strata.types import PriorityClass

CLASSES = sorted(PriorityClass, reverse=True)  # highest first
P = TypeVar("P")  # what the room rule grants: a slot, a pool placement


@dataclass(frozen=True, slots=True)
class Wording:
    """How a rule's refusals read (the room it lacks, for the client's message)."""

    no_room: str  # "the gateway is full", "no pool has room"
    timed_out: str  # with {limit_s}: "waited {limit_s:g}s in the gateway queue"


@dataclass(eq=False, slots=True)
class Waiter(Generic[P]):
    route: RouteRequest
    klass: PriorityClass
    future: asyncio.Future[P]


class ClassQueue(Generic[P]):
    """Holds the requests its room rule cannot take yet (see the module docstring).

    `room(route, klass)` takes room and returns the grant, or None when there is none;
    `give_back(grant)` returns it (for a waiter cancelled as it was granted)."""

    def __init__(self, room: Callable[[RouteRequest, PriorityClass], P | None],
                 give_back: Callable[[P], None], config: AdmissionConfig, bound: WaitBound,
                 wording: Wording, *, clock: Clock = time.monotonic,
                 recheck_s: float | None = None) -> None:
        self.room = room
        self.give_back = give_back
        self.config = config
        self.bound = bound
        self.wording = wording
        self.clock = clock
        self.recheck_s = recheck_s  # None: only a pump call places waiters (room is freed here)
        self.num_shed = dict.fromkeys(CLASSES, 0)
        self._waiters: dict[PriorityClass, deque[Waiter[P]]] = {k: deque() for k in CLASSES}
        self._pump_task: asyncio.Task[None] | None = None

    def num_queued(self, klass: PriorityClass | None = None) -> int:
        if klass is not None:
            return len(self._waiters[klass])
        return sum(len(w) for w in self._waiters.values())

    def waiting_classes(self) -> list[PriorityClass]:
        """The classes with a request waiting, highest first."""
        return [k for k in CLASSES if self._waiters[k]]

    async def acquire(self, route: RouteRequest) -> P:
        """The grant (give it back when the answer is sent); OverloadedError 429/503."""
        klass = PriorityClass.of(route.priority)
        if not any(self._waiters[k] for k in CLASSES if k >= klass):
            granted = self.room(route, klass)
            if granted is not None:
                return granted
        self._make_room(klass)
        return await self._wait(route, klass)

    def pump(self) -> None:
        """Grant room to waiters, highest class first, oldest first, while the rule gives it."""
        for klass in CLASSES:
            for waiter in list(self._waiters[klass]):
                if waiter.future.done():
                    continue
                granted = self.room(waiter.route, klass)
                if granted is not None:
                    self._waiters[klass].remove(waiter)
                    waiter.future.set_result(granted)

    def _make_room(self, klass: PriorityClass) -> None:
        if klass is PriorityClass.SHEDDABLE:
            raise self._shed(klass, f"sheddable requests are not queued: {self.wording.no_room}")
        if klass is PriorityClass.BATCH and \
                len(self._waiters[klass]) >= self.config.batch_max_queue:
            raise self._shed(klass, f"{self.config.batch_max_queue} batch requests already wait "
                                    f"({self.wording.no_room})")
        if self.num_queued() < self.config.max_queue:
            return
        for lower in reversed(CLASSES):
            if lower >= klass:
                break
            if self._waiters[lower]:  # its newest waiter makes room for a higher class
                self._waiters[lower].pop().future.set_exception(self._shed(
                    lower, f"a {klass.label} request took its place in the full queue"))
                return
        raise self._shed(klass, f"the gateway queue is full ({self.config.max_queue} wait)")

    def _shed(self, klass: PriorityClass, why: str) -> OverloadedError:
        self.num_shed[klass] += 1
        return OverloadedError(f"{why}; retry later", status_code=429,
                               retry_after_s=self.config.retry_after_s)

    async def _wait(self, route: RouteRequest, klass: PriorityClass) -> P:
        waiter: Waiter[P] = Waiter(route, klass, asyncio.get_running_loop().create_future())
        self._waiters[klass].append(waiter)
        self._start_pump()
        began = self.clock()
        try:
            while (remaining := self.bound.remaining_s(self.clock() - began)) > 0:
                with contextlib.suppress(TimeoutError):  # looks at the bound again
                    return await asyncio.wait_for(asyncio.shield(waiter.future),
                                                  min(remaining, self._recheck_bound_s))
            if self._granted(waiter):  # granted as the bound ran out: keep it
                return waiter.future.result()
            timed_out = self.wording.timed_out.format(limit_s=self.bound.limit_s())
            raise OverloadedError(f"{timed_out}; retry later", status_code=503,
                                  retry_after_s=self.config.retry_after_s) from None
        except asyncio.CancelledError:
            if self._granted(waiter):
                self.give_back(waiter.future.result())
            raise

    @property
    def _recheck_bound_s(self) -> float:
        """How often a waiter looks at its bound again (capacity may start or stop coming)."""
        return 10 * self.recheck_s if self.recheck_s is not None else 1.0

    def _granted(self, waiter: Waiter[P]) -> bool:
        """True if `waiter` was granted; otherwise cancels it and takes it out of the queue."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            return True
        future.cancel()
        if waiter in self._waiters[waiter.klass]:
            self._waiters[waiter.klass].remove(waiter)
        return False

    def _start_pump(self) -> None:
        """With `recheck_s`, while requests wait, look for room that appears without a release
        (an instance arrives, loads drop)."""
        if self.recheck_s is None:
            return
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump_while_waiting())

    async def _pump_while_waiting(self) -> None:
        assert self.recheck_s is not None
        while self.num_queued():
            await asyncio.sleep(self.recheck_s)
            self.pump()

    async def close(self) -> None:
        if self._pump_task is not None:
            self._pump_task.cancel()


__all__ = ["CLASSES", "ClassQueue", "Waiter", "Wording"]
