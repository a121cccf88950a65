"""Instance sources: a real in-memory registry, and static URLs learned over HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from gateway_fakes import FakeClock, Upstreams, json_answer

from strata.gateway.routing.instances import InstanceSet
from strata.gateway.routing.sources import RegistrySource, StaticSource
from strata.protocol.lora import AdapterResidency
from strata.registry import InstanceLoad, InstanceRecord, InstanceState, create_registry


def test_registry_source_mirrors_records_and_keeps_the_gateways_own_state() -> None:
    clock = FakeClock()
    registry = create_registry("memory://", ttl_s=5.0, clock=clock)
    source = RegistrySource(registry, InstanceSet())

    async def story() -> None:
        await registry.register(InstanceRecord("i1", "http://h1", "m", state=InstanceState.READY,
                                               load=InstanceLoad(num_running=2, adapters=(
                                                   AdapterResidency("sql", "d1"),))))
        await registry.register(InstanceRecord("i2", "http://h2", "m", version="v2",
                                               state=InstanceState.READY, deterministic=True))
        await source.refresh()
        i1 = source.instances.get("i1")
        assert i1 is not None and i1.reported.num_running == 2 and i1.is_routable
        assert [v.deterministic for v in source.instances.snapshot()] == [False, True]
        assert i1.is_resident("sql")  # the heartbeat's adapters reach the view
        i1.num_in_flight = 3  # the gateway's own accounting survives a refresh
        await registry.heartbeat("i1", state=InstanceState.DRAINING,
                                 load=InstanceLoad(num_waiting=4))
        clock.advance(3.0)
        await registry.heartbeat("i2")
        clock.advance(3.0)  # i1's heartbeat is now 6 s old: reported dead
        await source.refresh()
        assert source.instances.get("i1") is i1
        assert (i1.state, i1.reported.num_waiting, i1.num_in_flight) == ("dead", 4, 3)
        assert [v.instance_id for v in source.instances.snapshot() if v.is_routable] == ["i2"]
        await registry.deregister("i2")
        await source.refresh()
        assert [v.instance_id for v in source.instances.snapshot()] == ["i1"]
        await registry.close()

    asyncio.run(story())


class FlakyRegistry:
    """A registry whose reads fail while `is_down`."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.is_down = False

    async def list_instances(self) -> list[InstanceRecord]:
        if self.is_down:
            raise ConnectionError("registry unreachable")
        return await self.inner.list_instances()  # type: ignore[attr-defined,no-any-return]


def test_after_a_registry_outage_stale_heartbeats_of_healthy_instances_are_forgiven() -> None:
    clock = FakeClock()
    registry = create_registry("memory://", ttl_s=5.0, clock=clock)
    flaky = FlakyRegistry(registry)
    source = RegistrySource(flaky, InstanceSet(), outage_grace_s=10.0, clock=clock)

    async def story() -> None:
        for name in ("up", "gone"):
            await registry.register(InstanceRecord(name, f"http://{name}", "m",
                                                   state=InstanceState.READY))
        await source.refresh()
        up, gone = source.instances.get("up"), source.instances.get("gone")
        assert up is not None and gone is not None
        flaky.is_down = True
        clock.advance(10.0)  # ten seconds without the registry: the views stay as they were
        await source.refresh()
        assert up.is_routable and gone.is_routable
        gone.is_healthy = False  # the gateway's health checks found it dead meanwhile
        flaky.is_down = False
        await source.refresh()  # every heartbeat is stale at once
        assert (up.state, gone.state) == ("ready", "dead")
        clock.advance(9.0)
        await source.refresh()
        assert up.state == "ready"
        clock.advance(2.0)  # the grace is over: a heartbeat that did not resume counts
        await source.refresh()
        assert up.state == "dead"
        await registry.heartbeat("up")
        await source.refresh()
        assert up.state == "ready"
        await registry.close()

    asyncio.run(story())


def test_static_source_learns_models_and_load_and_waits_for_silent_instances() -> None:
    """Each card's `deterministic` too (absent: false)."""
    load: dict[str, Any] = {"num_running": 1, "num_waiting": 2, "kv_usage": 0.5,
                            "num_in_flight": 3, "draining": False,
                            "adapters": [{"name": "sql", "digest": "9f", "num_loads": 2}]}

    def a(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return json_answer({"object": "list",
                                "data": [{"id": "tiny", "deterministic": True}]})
        return json_answer(load)

    def b(request: httpx.Request) -> httpx.Response:  # an instance without /load
        if request.url.path == "/v1/models":
            return json_answer({"object": "list", "data": [{"id": "tiny"}]})
        return json_answer({"detail": "Not Found"}, 404)

    upstreams = Upstreams(a=a, b=b)  # c refuses connections

    async def story() -> None:
        async with httpx.AsyncClient(transport=upstreams.transport()) as client:
            source = StaticSource(["http://a/", "http://b", "http://c"], client)
            await source.refresh()
            views = {v.instance_id: v for v in source.instances.snapshot()}
            assert {k: (v.model, v.state) for k, v in views.items()} == {
                "a": ("tiny", "ready"), "b": ("tiny", "ready"), "c": ("", "starting")}
            assert views["a"].url == "http://a" and views["a"].reported.kv_usage == 0.5
            assert views["a"].serves("sql") and views["a"].is_resident("sql")
            assert not views["b"].serves("sql")
            assert views["a"].deterministic and not views["b"].deterministic  # b's card: none
            load["draining"] = True
            await source.refresh()
            assert views["a"].state == "draining"

    asyncio.run(story())
