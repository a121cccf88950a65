"""Adapter release stories (strata/registry/releases/adapter_steps.py) in the release world of
release_world.py (memory registries, a fake clock; base model `m@v1` live on two READY
instances) with a fake fleet whose loads show in the instances' heartbeats at once.

A release of sql@a2 over a1 loads a2 on both instances, warms each, flips, then unloads a1; no
deployment is written and no instance starts or stops. A failed warm-up rolls back before the
flip (a2 unloaded, a1 live). A rollback asked for after the flip loads a1 again, warms it,
flips back, then unloads a2."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from release_world import CONFIG, World, states

from strata.protocol.lora import AdapterResidency
from strata.registry import InstanceRecord
from strata.registry.models import ModelRouting, ModelVersion, ReleaseState
from strata.registry.releases.controller import ReleaseController

S = ReleaseState
INSTANCES = ("m-v1-0", "m-v1-1")


class FakeFleet:
    """Loads and unloads edit the instance's heartbeat load; `events` in order."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.events: list[str] = []
        self.cold: set[str] = set()  # adapter names whose warm-up fails

    async def load(self, record: InstanceRecord, lora_name: str, path: str,
                   sha256: str) -> None:
        self.events.append(f"load {lora_name} {record.instance_id} {path} {sha256[:1]}")
        await self._edit(record, lambda names: names | {lora_name})

    async def unload(self, record: InstanceRecord, lora_name: str) -> None:
        self.events.append(f"unload {lora_name} {record.instance_id}")
        await self._edit(record, lambda names: names - {lora_name})

    async def warm(self, record: InstanceRecord, lora_name: str) -> None:
        self.events.append(f"warm {lora_name} {record.instance_id}")
        if lora_name in self.cold:
            raise RuntimeError(f"{lora_name} answered 500")

    async def _edit(self, record: InstanceRecord,
                    change: Callable[[set[str]], set[str]]) -> None:
        stored = next(r for r in await self.world.instances.list_instances()
                      if r.instance_id == record.instance_id)
        names = change({a.name for a in stored.load.adapters})
        load = replace(stored.load, adapters=tuple(AdapterResidency(n, "d")
                                                   for n in sorted(names)))
        await self.world.instances.heartbeat(record.instance_id, load=load)


async def adapter_world() -> tuple[World, FakeFleet, ReleaseController]:
    world = await World.create()
    for version in ("a1", "a2"):
        await world.models.add_version(ModelVersion("sql", version, f"file:///ad/{version}",
                                                     version[-1] * 64, base="m"))
    fleet = FakeFleet(world)
    for iid in INSTANCES:
        record = next(r for r in await world.instances.list_instances() if r.instance_id == iid)
        await fleet.load(record, "sql@a1", "/ad/a1", "1" * 64)
    await world.models.set_routing(ModelRouting("sql", live="a1"), expected_revision=0)
    fleet.events.clear()
    return world, fleet, world.controller("gw-1", adapters=fleet)


async def routing(world: World) -> tuple[str | None, str | None]:
    found = await world.models.get_routing("sql")
    assert found is not None
    return found.live, found.previous


def test_a_release_loads_warms_flips_and_unloads_without_touching_instances() -> None:
    async def story() -> None:
        world, fleet, controller = await adapter_world()
        deployments = await world.deployments()
        started = await controller.start("sql", "a2")
        assert (started.base, started.replicas, started.from_version) == ("m", 2, "a1")
        done = await controller.drive(started.release_id)
        assert states(done) == ["pending", "starting", "warming", "flipping", "retiring", "done"]
        assert fleet.events == [
            "load sql@a2 m-v1-0 /ad/a2 2", "load sql@a2 m-v1-1 /ad/a2 2",
            "warm sql@a2 m-v1-0", "warm sql@a2 m-v1-1",
            "unload sql@a1 m-v1-0", "unload sql@a1 m-v1-1"]
        assert await routing(world) == ("a2", "a1")
        assert await world.deployments() == deployments and world.launcher.events == []
        assert await world.ready_ids("v1") == list(INSTANCES)
    asyncio.run(story())


def test_a_failed_warm_up_rolls_back_before_the_flip() -> None:
    async def story() -> None:
        world, fleet, controller = await adapter_world()
        fleet.cold.add("sql@a2")
        final = await controller.drive((await controller.start("sql", "a2")).release_id)
        assert final.state is S.ROLLED_BACK and "sql@a2 answered 500" in final.reason
        assert "flipping" not in states(final)
        assert fleet.events[-2:] == ["unload sql@a2 m-v1-0", "unload sql@a2 m-v1-1"]
        assert await routing(world) == ("a1", None)
    asyncio.run(story())


def test_a_rollback_after_the_flip_loads_the_old_version_again_then_flips_back() -> None:
    async def story() -> None:
        world, fleet, _ = await adapter_world()

        async def sleep(seconds: float) -> None:  # ask for the rollback while it retires a1
            await world.sleep(seconds)
            stored = await world.models.get_release(started.release_id)
            if stored is not None and stored.state is S.RETIRING:
                await controller.request_rollback("sql")
        controller = ReleaseController(world.models, world.instances, owner="gw-1",
                                       warm=world.warm, config=CONFIG, clock=world.clock,
                                       sleep=sleep, adapters=fleet)
        started = await controller.start("sql", "a2")
        final = await controller.drive(started.release_id)
        assert final.state is S.ROLLED_BACK, final
        assert states(final)[-3:] == ["retiring", "rolling_back", "rolled_back"]
        after_flip = fleet.events[fleet.events.index("warm sql@a2 m-v1-1") + 1:]
        assert [e for e in after_flip if e.startswith(("load", "warm"))] == [
            "load sql@a1 m-v1-0 /ad/a1 1", "load sql@a1 m-v1-1 /ad/a1 1",
            "warm sql@a1 m-v1-0", "warm sql@a1 m-v1-1"]
        assert after_flip[-2:] == ["unload sql@a2 m-v1-0", "unload sql@a2 m-v1-1"]
        assert await routing(world) == ("a1", "a2")
    asyncio.run(story())
