"""Dead sockets: an instance that stops answering without closing its connections (frozen,
powered off, cut off by the network) holds every request it has until the read timeout, 120 s.
The stall watch ends them within about `stall_s + stall_sweep_s + stall_probe_timeout_s`.

Every attempt the proxy has in flight is `Watched`: each wait on its instance (the answer's
headers, the next chunk) runs in a timeout scope with no deadline, and the time data last came
is kept. Every `stall_sweep_s` the watch looks for attempts waiting for more than `stall_s`
since their instance last sent anything; each such instance gets one `/health` probe (a probe at
a time per instance). If the probe fails (no answer within `stall_probe_timeout_s`, refused, not
200), the stalled waits on that instance are ended at once: their scope's deadline is moved to
now, so the wait raises `TimeoutError` (an `OSError`: the proxy's usual upstream failure), the
stream is resumed elsewhere (strata/gateway/upstream/resume.py) or, before the first byte, the
request is retried. A silent instance that answers its probe (a long prefill) is left alone; a wait
that is not on the instance (a slow client) is never a stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from strata.clock import Clock
from strata.gateway.config import ResumeConfig
from strata.gateway.routing.instances import InstanceView

T = TypeVar("T")
logger = logging.getLogger("strata.gateway")


@dataclass(eq=False, slots=True)
class Watched:
    """One attempt on one instance: its waits can be ended from outside."""

    view: InstanceView
    last_data_at: float
    clock: Clock
    scope: asyncio.Timeout | None = None  # while waiting on the instance
    was_ended: bool = False
    is_waiting: bool = False  # on the next chunk of an answer that can be failed (`fail`)
    fail: Callable[[Exception], None] | None = None

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """`await awaitable`, ended with TimeoutError when the watch finds the instance dead."""
        try:
            async with asyncio.timeout(None) as self.scope:
                return await awaitable
        finally:
            self.scope = None
            self.last_data_at = self.clock()

    async def chunks(self, chunks: AsyncIterator[bytes],
                     fail: Callable[[Exception], None] | None = None) -> AsyncIterator[bytes]:
        """`chunks`, each wait for the next one watched. With `fail` (the lean client's answer
        ends its own wait with the error it is given: connection.py), no timeout scope is
        opened per chunk: ending the wait fails the answer."""
        if fail is None:
            while True:
                try:
                    chunk = await self.wait(anext(chunks))
                except StopAsyncIteration:
                    return
                yield chunk
        self.fail = fail
        try:
            while True:
                self.is_waiting = True
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                finally:
                    self.is_waiting = False
                    self.last_data_at = self.clock()
                yield chunk
        finally:
            self.fail = None

    def silent_s(self, now: float) -> float:
        """How long it has waited on its instance with nothing coming (0 when not waiting)."""
        is_waiting = self.scope is not None or self.is_waiting
        return now - self.last_data_at if is_waiting else 0.0

    def end(self) -> None:
        if self.scope is not None:
            self.was_ended = True
            self.scope.reschedule(asyncio.get_running_loop().time())
        elif self.is_waiting and self.fail is not None:
            self.was_ended = True
            self.fail(TimeoutError("the instance went silent"))  # an OSError, as the scope's


@dataclass(slots=True)
class StallWatch:
    """The attempts in flight by instance, and the sweep that ends those of a dead instance."""

    config: ResumeConfig
    client: httpx.AsyncClient
    clock: Clock = time.monotonic
    on_dead: Callable[[InstanceView, int], None] | None = None  # (instance, attempts ended)
    watched: dict[str, set[Watched]] = field(default_factory=dict)
    probes: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def open(self, view: InstanceView) -> Watched:
        watched = Watched(view, self.clock(), self.clock)
        self.watched.setdefault(view.instance_id, set()).add(watched)
        return watched

    def close(self, watched: Watched) -> None:
        attempts = self.watched.get(watched.view.instance_id)
        if attempts is not None:
            attempts.discard(watched)
            if not attempts:
                del self.watched[watched.view.instance_id]

    def stalled(self, instance_id: str) -> list[Watched]:
        now = self.clock()
        return [w for w in self.watched.get(instance_id, ())
                if w.silent_s(now) >= self.config.stall_s]

    async def sweep(self) -> None:
        """Probe each instance with a stalled attempt (in the background: never blocks)."""
        for instance_id in list(self.watched):
            stalled = self.stalled(instance_id)
            if stalled and instance_id not in self.probes:
                task = asyncio.create_task(self._probe(stalled[0].view))
                self.probes[instance_id] = task
                task.add_done_callback(functools.partial(self._probed, instance_id))

    def _probed(self, instance_id: str, task: asyncio.Task[None]) -> None:
        if self.probes.get(instance_id) is task:
            del self.probes[instance_id]

    async def _probe(self, view: InstanceView) -> None:
        if await self._is_alive(view):
            return
        stalled = self.stalled(view.instance_id)
        logger.warning("instance %s is silent and failed a probe: ending %d attempts",
                       view.instance_id, len(stalled))
        for watched in stalled:
            watched.end()
        if self.on_dead is not None:
            self.on_dead(view, len(stalled))

    async def _is_alive(self, view: InstanceView) -> bool:
        try:
            response = await self.client.get(f"{view.url}/health",
                                              timeout=self.config.stall_probe_timeout_s)
        except Exception:  # httpx's errors, and what a connection reset as it opens may raise
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        for task in list(self.probes.values()):
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self.probes.values(), return_exceptions=True)


__all__ = ["StallWatch", "Watched"]
