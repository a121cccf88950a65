"""Priority classes at the gateway (strata/gateway/path/classes.py) and class-ordered admission:
class -> pool routing, spill-over only with room, flow control by class, shedding."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from gateway_fakes import FixedSource, Upstreams, json_answer, view

from strata.errors import OverloadedError
from strata.gateway.app import create_gateway_app
from strata.gateway.config import AdmissionConfig, ClassConfig, GatewayConfig
from strata.gateway.path.admission import Admission
from strata.gateway.path.classes import ClassFlow, Placement
from strata.gateway.routing.instances import InstanceSet
from strata.gateway.routing.policies.base import RouteRequest
from strata.types import PriorityClass

INT, S = PriorityClass.INTERACTIVE, PriorityClass.STANDARD
B, X = PriorityClass.BATCH, PriorityClass.SHEDDABLE


def fleet(**pools: int) -> InstanceSet:
    return InstanceSet([view(f"{pool}-{k}", pool=pool)
                        for pool, count in pools.items() for k in range(count)])


def flow(instances: InstanceSet, *, slots: int = 2, batch_max_queue: int = 2,
         max_queue: int = 8, hold: bool = False, timeout_s: float = 30.0,
         **class_pools: str) -> ClassFlow:
    config = ClassConfig(class_pools=tuple(class_pools.items()), instance_slots=slots,
                         hold_without_instances=hold, recheck_s=0.01)
    admission = AdmissionConfig(max_queue=max_queue, batch_max_queue=batch_max_queue,
                                queue_timeout_s=timeout_s)
    return ClassFlow(config, admission, instances)


def req(klass: PriorityClass, model: str = "m") -> RouteRequest:
    return RouteRequest(model=model, priority=int(klass))


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_classes_go_to_their_pools_and_the_rest_to_the_unnamed_ones() -> None:
    async def story() -> None:
        f = flow(fleet(fast=1, bulk=2, spare=1), interactive="fast", batch="bulk")
        assert (await f.acquire(req(INT))).pool == "fast"
        assert (await f.acquire(req(B))).pool == "bulk"
        assert (await f.acquire(req(S))).pool == "spare"  # no class names it
        assert (await f.acquire(req(X))).pool == "spare"

    asyncio.run(story())


def test_spill_over_only_to_a_pool_with_room_for_that_class() -> None:
    async def story() -> None:
        f = flow(fleet(fast=1, bulk=1), slots=2, interactive="fast")
        got = [(await f.acquire(req(B))).pool for _ in range(4)]
        assert got == ["bulk", "bulk", "fast", "fast"]  # batch fills an idle fast pool too
        # interactive counts only its own class: a fast pool full of batch has room for it
        assert [(await f.acquire(req(INT))).pool for _ in range(2)] == ["fast", "fast"]
        # two interactive in flight fill fast for interactive; bulk has room for it only if
        # nothing of its class or above is there: batch (below it) does not count
        assert (await f.acquire(req(INT))).pool == "bulk"
        assert f.in_flight == {("bulk", B): 2, ("fast", B): 2, ("fast", INT): 2, ("bulk", INT): 1}
        tight = flow(fleet(bulk=1), slots=1, batch_max_queue=0)
        await tight.acquire(req(B))
        with pytest.raises(OverloadedError):  # batch: no room anywhere, its queue bound 0
            await tight.acquire(req(B))

    asyncio.run(story())


def test_at_saturation_sheddable_then_batch_are_refused_at_once_with_retry_after() -> None:
    async def story() -> None:
        f = flow(fleet(bulk=1), slots=1, batch_max_queue=1)
        held = await f.acquire(req(S))
        started = time.perf_counter()
        with pytest.raises(OverloadedError) as shed:
            await f.acquire(req(X))
        assert time.perf_counter() - started < 0.005
        assert (shed.value.status_code, shed.value.retry_after_s) == (429, 1.0)
        waiting_batch = asyncio.create_task(f.acquire(req(B)))
        await settle()
        with pytest.raises(OverloadedError) as second:
            await f.acquire(req(B))  # one batch request already waits
        assert second.value.status_code == 429
        waiting_std = asyncio.create_task(f.acquire(req(S)))
        await settle()
        assert (f.num_queued(B), f.num_queued(S), f.num_shed[X], f.num_shed[B]) == (1, 1, 1, 1)
        f.release(held)  # the standard waiter goes first, though the batch one came first
        await settle()
        assert waiting_std.done() and not waiting_batch.done()
        f.release(waiting_std.result())
        assert (await waiting_batch).klass is B

    asyncio.run(story())


def test_a_full_queue_refuses_its_newest_lower_waiter_to_make_room() -> None:
    async def story() -> None:
        f = flow(fleet(bulk=1), slots=1, max_queue=2, batch_max_queue=5)
        await f.acquire(req(INT))  # no room for any class now
        first, second = (asyncio.create_task(f.acquire(req(B))) for _ in range(2))
        await settle()
        urgent = asyncio.create_task(f.acquire(req(S)))
        await settle()
        with pytest.raises(OverloadedError, match="took its place"):
            await second
        assert not first.done() and not urgent.done() and f.num_queued() == 2
        with pytest.raises(OverloadedError, match="queue is full"):
            await f.acquire(req(B))
        for task in (first, urgent):
            task.cancel()

    asyncio.run(story())


def test_requests_wait_for_the_first_instance_when_asked_to() -> None:
    async def story() -> None:
        instances = InstanceSet()
        f = flow(instances, hold=True)
        waiting = asyncio.create_task(f.acquire(req(S)))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        instances.add(view("new-0", pool="default"))
        assert await asyncio.wait_for(waiting, 5) == Placement("default", S)
        passing = flow(InstanceSet())  # without hold: the proxy answers (404/503) at once
        assert await passing.acquire(req(S)) == Placement("", S)

    asyncio.run(story())


def test_a_waiter_not_placed_in_time_gets_503() -> None:
    async def story() -> None:
        f = flow(fleet(bulk=1), slots=1, timeout_s=0.05)
        await f.acquire(req(INT))
        with pytest.raises(OverloadedError) as late:
            await f.acquire(req(S))
        assert late.value.status_code == 503 and f.num_queued() == 0

    asyncio.run(story())


def test_admission_serves_waiters_by_class_and_never_queues_sheddable() -> None:
    admission = Admission(AdmissionConfig(max_in_flight=1, max_queue=4, batch_max_queue=1))
    order: list[str] = []

    async def enter(name: str, klass: PriorityClass) -> None:
        await admission.acquire(int(klass))
        order.append(name)

    async def story() -> None:
        await enter("first", S)
        tasks = [asyncio.create_task(enter(n, k)) for n, k in (("b", B), ("s", S), ("i", INT))]
        await settle()
        with pytest.raises(OverloadedError):
            await admission.acquire(int(X))
        with pytest.raises(OverloadedError):
            await admission.acquire(int(B))  # batch_max_queue 1
        for _ in range(3):
            admission.release()
            await settle()
        await asyncio.gather(*tasks)
        assert order == ["first", "i", "s", "b"]

    asyncio.run(story())


def test_the_gateway_forwards_the_clamped_priority_to_the_instance() -> None:
    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("x-priority"))
        return json_answer({"id": "cmpl-1", "choices": []})

    upstreams = Upstreams(a=answer)
    config = GatewayConfig(api_keys=("k-batch", "k-any"), key_max_priority=(("k-batch", -10),))
    app = create_gateway_app(config, FixedSource(view("a")), transport=upstreams.transport(),
                             run_background=False)

    async def story() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for key, headers, body in (("k-batch", {"x-priority": "interactive"}, {}),
                                       ("k-any", {"x-priority": "interactive"}, {}),
                                       ("k-any", {}, {"priority": "batch"}),
                                       ("k-any", {}, {})):
                response = await client.post(
                    "/v1/completions", json={"model": "m", "prompt": "x", **body},
                    headers={"authorization": f"Bearer {key}", **headers})
                assert response.status_code == 200

    asyncio.run(story())
    assert seen == ["-10", "10", "-10", "0"]


def test_with_classes_on_the_class_step_is_the_outermost_queue() -> None:
    """Only the tenants' meter comes before it (a key over its budget is refused before it
    queues anywhere)."""
    import functools

    from strata.gateway.wiring import build_gateway

    def steps(config: GatewayConfig) -> list[str]:
        gateway = build_gateway(config, FixedSource(view("a")))
        names, handler = [], gateway.forward
        while isinstance(handler, functools.partial):
            names.append(type(handler.func).__name__)
            handler = handler.keywords["call_next"]
        asyncio.run(gateway.close())
        return names

    assert steps(GatewayConfig()) == ["MeterTenants", "Admit"]
    assert steps(GatewayConfig(classes=ClassConfig(instance_slots=2))) == [
        "MeterTenants", "RouteByClass", "Admit"]
