"""Admission control: a cap on requests in flight and a bounded queue, served by class.

A request past the cap waits in the queue of its priority class (strata.types.PriorityClass);
a released slot passes straight to the oldest waiter of the highest class, so the count in
flight never exceeds the cap and an interactive request never waits behind a batch one. At the
cap, a sheddable request is refused at once (429), and a batch one once `batch_max_queue` batch
requests wait; a full queue makes room for a higher class by refusing its newest lower waiter
(429), or refuses the newcomer. One that waited `queue_timeout_s` gives up (503). All carry
Retry-After.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from strata.errors import OverloadedError
from strata.gateway.config import AdmissionConfig
from strata.types import PriorityClass

CLASSES_FIRST_TO_LAST = sorted(PriorityClass, reverse=True)


class Admission:
    """Counts in-flight requests; `slot()` holds one for the duration of a request."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.num_in_flight = 0
        self._waiters: dict[PriorityClass, deque[asyncio.Future[None]]] = {
            klass: deque() for klass in CLASSES_FIRST_TO_LAST}

    @property
    def num_queued(self) -> int:
        return sum(len(waiters) for waiters in self._waiters.values())

    def num_queued_of(self, klass: PriorityClass) -> int:
        return len(self._waiters[klass])

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, priority: int = 0) -> None:
        """Takes a slot, waiting in the queue if needed; raises OverloadedError (429/503)."""
        klass = PriorityClass.of(priority)
        is_ahead = all(not self._waiters[c] for c in CLASSES_FIRST_TO_LAST if c >= klass)
        if self.num_in_flight < self.config.max_in_flight and is_ahead:
            self.num_in_flight += 1
            return
        self._make_queue_room(klass)
        await self._wait(klass)

    def _make_queue_room(self, klass: PriorityClass) -> None:
        if klass is PriorityClass.SHEDDABLE:
            raise self._refusal("sheddable requests are not queued while the gateway is full")
        if klass is PriorityClass.BATCH and \
                len(self._waiters[klass]) >= self.config.batch_max_queue:
            raise self._refusal(f"{self.config.batch_max_queue} batch requests are already "
                                "waiting at the gateway")
        if self.num_queued < self.config.max_queue:
            return
        for lower in reversed(CLASSES_FIRST_TO_LAST):
            if lower >= klass:
                break
            if self._waiters[lower]:  # its newest waiter makes room for a higher class
                self._waiters[lower].pop().set_exception(self._refusal(
                    f"a {klass.label} request took this request's place in the full queue"))
                return
        raise self._refusal(f"the gateway queue is full ({self.config.max_queue} waiting)")

    def _refusal(self, why: str) -> OverloadedError:
        return OverloadedError(f"{why}; retry later", retry_after_s=self.config.retry_after_s,
                               status_code=429)

    async def _wait(self, klass: PriorityClass) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[klass].append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.config.queue_timeout_s)
        except TimeoutError:
            if self._granted(waiter, klass):  # the slot arrived as the timeout fired: keep it
                return
            raise OverloadedError(
                f"waited {self.config.queue_timeout_s:g}s in the gateway queue; retry later",
                retry_after_s=self.config.retry_after_s, status_code=503) from None
        except asyncio.CancelledError:
            if self._granted(waiter, klass):
                self.release()
            raise

    def _granted(self, waiter: asyncio.Future[None], klass: PriorityClass) -> bool:
        """True if `waiter` got a slot; otherwise cancels it and leaves the queue."""
        if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            return True
        waiter.cancel()
        if waiter in self._waiters[klass]:
            self._waiters[klass].remove(waiter)
        return False

    def release(self) -> None:
        """Gives the slot to the oldest waiter of the highest class, or frees it."""
        for klass in CLASSES_FIRST_TO_LAST:
            waiters = self._waiters[klass]
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    return
        self.num_in_flight -= 1


__all__ = ["Admission"]
