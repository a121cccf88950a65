"""`AdapterSync` as a story over in-memory registries and a fake fleet with an injected clock: an
instance of the base's live version that does not list an adapter's live (or canary) version is
asked to load it, with its registered path and sha256; one that lists it, one of another base
version, another model or one not ready is left alone; an instance is asked again only after
retry_s, and a failing load is logged, never raised. And an adapter's release needs a ready
instance of its base to load on."""

from __future__ import annotations

import asyncio

import pytest

from strata.errors import InvalidRequestError
from strata.protocol.lora import AdapterResidency
from strata.registry import create_model_registry, create_registry
from strata.registry.instances.base import Registry
from strata.registry.instances.records import InstanceLoad, InstanceRecord, InstanceState
from strata.registry.models import ModelRegistry, ModelRouting, ModelVersion
from strata.registry.releases.adapter_sync import AdapterSync
from strata.registry.releases.controller import ReleaseController

SHA = {"v1": "1" * 64, "v2": "2" * 64, "v3": "3" * 64}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeFleet:
    def __init__(self) -> None:
        self.loads: list[tuple[str, str, str, str]] = []
        self.is_failing = False

    async def load(self, record: InstanceRecord, lora_name: str, path: str,
                   sha256: str) -> None:
        self.loads.append((record.instance_id, lora_name, path, sha256))
        if self.is_failing:
            raise RuntimeError("refused")

    async def unload(self, record: InstanceRecord, lora_name: str) -> None:
        raise AssertionError("the sync never unloads")

    async def warm(self, record: InstanceRecord, lora_name: str) -> None:
        raise AssertionError("the sync never warms")


def record(iid: str, model: str = "tiny", version: str = "v1", *,
           state: InstanceState = InstanceState.READY, lists: tuple[str, ...] = ()
           ) -> InstanceRecord:
    load = InstanceLoad(adapters=tuple(AdapterResidency(name, "d") for name in lists))
    return InstanceRecord(iid, f"http://{iid}", model, version, state=state, load=load)


async def world() -> tuple[AdapterSync, FakeFleet, FakeClock, ModelRegistry, Registry]:
    models, instances = create_model_registry("memory://"), create_registry("memory://")
    await models.add_version(ModelVersion("tiny", "v1", "/m/tiny"))
    await models.set_routing(ModelRouting("tiny", live="v1"), expected_revision=0)
    for v in ("v1", "v2", "v3"):
        await models.add_version(ModelVersion("sql", v, f"file:///a/sql-{v}", SHA[v],
                                              base="tiny"))
    await models.set_routing(ModelRouting("sql", live="v2", previous="v1"), expected_revision=0)
    for r in (record("i-0", lists=("sql@v2",)), record("i-1"), record("i-2", version="v0"),
              record("i-3", model="other"), record("i-4", state=InstanceState.STARTING)):
        await instances.register(r)
    fleet, clock = FakeFleet(), FakeClock()
    return AdapterSync(models, instances, fleet, retry_s=5.0, clock=clock), fleet, clock, \
        models, instances


def test_instances_that_lack_a_serving_version_load_it_and_are_asked_again_after_retry_s(
        ) -> None:
    async def story() -> None:
        sync, fleet, clock, models, instances = await world()
        assert await sync.sync_once() == 1
        assert fleet.loads == [("i-1", "sql@v2", "/a/sql-v2", SHA["v2"])]
        assert await sync.sync_once() == 0           # asked 0 s ago: not again yet
        clock.advance(5.0)
        fleet.is_failing = True
        assert await sync.sync_once() == 1           # still not listed: asked again, fails
        fleet.is_failing = False
        await instances.register(record("i-1", lists=("sql@v2",)))
        clock.advance(5.0)
        assert await sync.sync_once() == 0
        routing = await models.get_routing("sql")
        assert routing is not None
        await models.set_routing(
            ModelRouting("sql", live="v2", previous="v1", canary="v3", canary_weight=0.1),
            expected_revision=routing.revision)
        assert await sync.sync_once() == 2           # the canary takes traffic too
        assert sorted(load[:2] for load in fleet.loads[-2:]) == [("i-0", "sql@v3"),
                                                                 ("i-1", "sql@v3")]
    asyncio.run(story())


def test_an_adapter_release_needs_a_ready_instance_of_its_base() -> None:
    async def story() -> None:
        _, fleet, _, models, _ = await world()

        async def warm(r: InstanceRecord) -> None:
            return None
        controller = ReleaseController(models, create_registry("memory://"),
                                       owner="t", warm=warm, adapters=fleet)
        with pytest.raises(InvalidRequestError, match="no ready instance to load it on"):
            await controller.start("sql", "v3")
        bare = ReleaseController(models, create_registry("memory://"),
                                 owner="t", warm=warm)
        with pytest.raises(InvalidRequestError, match="cannot load adapters"):
            await bare.start("sql", "v3")
    asyncio.run(story())
