"""Admission control: a cap on requests in flight and a bounded FIFO queue with a timeout.

A request past the cap waits in the queue; a full queue refuses it at once (429), and one that
waited `queue_timeout_s` gives up (503). Both carry Retry-After. A released slot passes straight to
the oldest waiter, so the count in flight never exceeds the cap and the queue is served in order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from strata.errors import OverloadedError
from strata.gateway.config import AdmissionConfig


class Admission:
    """Counts in-flight requests; `slot()` holds one for the duration of a request."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.num_in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self) -> None:
        """Takes a slot, waiting in the queue if needed; raises OverloadedError (429/503)."""
        if self.num_in_flight < self.config.max_in_flight and not self._waiters:
            self.num_in_flight += 1
            return
        if len(self._waiters) >= self.config.max_queue:
            raise OverloadedError(f"the gateway queue is full ({self.config.max_queue} waiting); "
                                  "retry later", retry_after_s=self.config.retry_after_s,
                                  status_code=429)
        await self._wait()

    async def _wait(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.config.queue_timeout_s)
        except TimeoutError:
            if self._granted(waiter):  # the slot arrived as the timeout fired: keep it
                return
            raise OverloadedError(
                f"waited {self.config.queue_timeout_s:g}s in the gateway queue; retry later",
                retry_after_s=self.config.retry_after_s, status_code=503) from None
        except asyncio.CancelledError:
            if self._granted(waiter):
                self.release()
            raise

    def _granted(self, waiter: asyncio.Future[None]) -> bool:
        """True if `waiter` got a slot; otherwise cancels it and leaves the queue."""
        if waiter.done() and not waiter.cancelled():
            return True
        waiter.cancel()
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        return False

    def release(self) -> None:
        """Gives the slot to the oldest waiter, or frees it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.num_in_flight -= 1


__all__ = ["Admission"]
