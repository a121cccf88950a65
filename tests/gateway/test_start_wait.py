"""A request waiting at the gateway for an instance that is starting waits as long as a start
takes (`start_wait_s`), not `queue_timeout_s` (strata/gateway/path/start_wait.py); on an injected
clock, each step ordered by the waiter looking at its bound again."""

from __future__ import annotations

import asyncio

import pytest
from gateway_fakes import view

from strata.clock import ManualClock
from strata.errors import OverloadedError
from strata.gateway.config import AdmissionConfig, ClassConfig
from strata.gateway.path.classes import ClassFlow
from strata.gateway.path.start_wait import WaitBound
from strata.gateway.routing.instances import READY, STARTING, InstanceSet
from strata.gateway.routing.policies.base import RouteRequest

pytestmark = pytest.mark.timeout(20)


def test_the_bound_is_the_start_wait_while_capacity_comes_and_the_queue_timeout_otherwise() -> None:
    coming = {"now": False}
    bound = WaitBound(queue_timeout_s=10.0, start_wait_s=60.0, signs=[lambda: coming["now"]])
    assert (bound.limit_s(), bound.remaining_s(4.0)) == (10.0, 6.0)
    coming["now"] = True
    assert (bound.limit_s(), bound.remaining_s(12.0)) == (60.0, 48.0)
    assert WaitBound(10.0, 5.0, [lambda: True]).limit_s() == 10.0  # never shorter


class Story:
    """A flow over one instance, its clock manual; `looked` is set each time a waiter looks at
    its bound (after the clock moved, that is the waiter seeing the new time)."""

    def __init__(self, state: str) -> None:
        self.instance = view("m-0", state=state)
        self.clock = ManualClock(0.0)
        self.flow = ClassFlow(
            ClassConfig(instance_slots=1, hold_without_instances=True, recheck_s=0.01),
            AdmissionConfig(queue_timeout_s=10.0, start_wait_s=60.0),
            InstanceSet([self.instance]), self.clock)
        self.looked = asyncio.Event()
        self.flow.bound.signs.insert(0, self._look)  # the first: always asked

    def _look(self) -> bool:
        self.looked.set()
        return False

    async def wait(self) -> asyncio.Task[object]:
        """A request that began to wait at the clock's time now."""
        self.looked.clear()
        waiting = asyncio.create_task(self.flow.acquire(RouteRequest(model="m")))
        await self.looked.wait()
        return waiting  # type: ignore[return-value]

    async def advance_to(self, t: float) -> None:
        self.looked.clear()
        self.clock.set(t)
        await self.looked.wait()


def test_a_request_waits_past_the_queue_timeout_for_a_starting_instance_and_is_served() -> None:
    async def story() -> None:
        s = Story(STARTING)
        waiting = await s.wait()
        await s.advance_to(30.0)  # three queue timeouts: still waiting for the start
        assert not waiting.done()
        s.instance.state = READY
        assert (await waiting).pool == "default"  # type: ignore[attr-defined]

    asyncio.run(story())


def test_without_a_starting_instance_the_queue_timeout_holds() -> None:
    async def story() -> None:
        s = Story(READY)
        s.instance.is_draining = True  # no room, and nothing on its way
        waiting = await s.wait()
        await s.advance_to(10.5)
        with pytest.raises(OverloadedError, match="no room for 10s|had room for 10s"):
            await waiting

    asyncio.run(story())


def test_an_instance_that_never_gets_ready_bounds_the_wait_at_the_start_wait() -> None:
    async def story() -> None:
        s = Story(STARTING)
        waiting = await s.wait()
        await s.advance_to(59.0)
        assert not waiting.done()
        await s.advance_to(60.5)
        with pytest.raises(OverloadedError, match="had room for 60s") as refused:
            await waiting
        assert refused.value.status_code == 503

    asyncio.run(story())
