"""A world for release stories: memory registries on a fake clock, and a fake launcher that plays
the real launchers' contract against them (the boundary the release controller owns; real
processes are tested with the launchers).

Time moves only through `World.sleep` (the controllers' injected sleep): each call advances the
clock and lets the launcher reconcile once, so every story is deterministic. A World on the real
clock (`time.time`) sleeps for real instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from strata.clock import ManualClock
from strata.registry import InstanceRecord, InstanceState, Registry, create_registry
from strata.registry.models import (
    Deployment,
    DeploymentState,
    ModelRegistry,
    ModelRouting,
    ModelVersion,
    Release,
    ReleaseState,
    create_model_registry,
)
from strata.registry.releases.controller import ReleaseController
from strata.registry.releases.policy import ReleaseConfig, VersionHealth

CONFIG = ReleaseConfig(ready_timeout_s=10.0, retire_timeout_s=10.0, poll_s=0.2, lease_s=2.0,
                       canary_window_s=3.0, canary_min_requests=20, propagation_s=1.0)


class FakeLauncher:
    """ACTIVE deployments get `replicas` instances (registered STARTING, READY `start_s` later,
    never for a version in `never_ready`); RETIRING ones drain (DRAINING, deregistered
    `stop_s` later) and the deployment is deleted once none is left. `events`: (time, what)."""

    def __init__(self, models: ModelRegistry, instances: Registry,
                 clock: Callable[[], float]) -> None:
        self.models, self.instances, self.clock = models, instances, clock
        self.start_s, self.stop_s = 1.0, 1.0
        self.never_ready: set[str] = set()
        self.events: list[tuple[float, str]] = []
        self._since: dict[str, float] = {}  # instance id -> when it registered or began draining
        self._num_started = 0

    async def reconcile(self) -> None:
        for record in await self.instances.list_instances():
            await self._advance(record)
        for deployment in await self.models.list_deployments():
            mine = [r for r in await self.instances.list_instances()
                    if r.model_version == deployment.key]
            if deployment.state is DeploymentState.ACTIVE:
                await self._scale(deployment, mine)
            else:
                await self._drain(deployment, mine)

    async def _scale(self, deployment: Deployment, mine: list[InstanceRecord]) -> None:
        running = [r for r in mine if r.state is not InstanceState.DRAINING]
        for _ in range(deployment.replicas - len(running)):
            instance_id = f"{deployment.name}-{deployment.version}-{self._num_started}"
            self._num_started += 1
            await self.instances.register(InstanceRecord(
                instance_id=instance_id, url=f"http://127.0.0.1:{9000 + self._num_started}",
                model=deployment.name, version=deployment.version))
            self._note(instance_id, "register")

    async def _drain(self, deployment: Deployment, mine: list[InstanceRecord]) -> None:
        if not mine:
            await self.models.delete_deployment(deployment.name, deployment.version)
            self.events.append((self.clock(), f"delete {deployment.key}"))
        for record in mine:
            if record.state is not InstanceState.DRAINING:
                await self.instances.heartbeat(record.instance_id, state=InstanceState.DRAINING)
                self._note(record.instance_id, "drain")

    async def _advance(self, record: InstanceRecord) -> None:
        waited_s = self.clock() - self._since[record.instance_id]
        if record.state is InstanceState.DRAINING and waited_s >= self.stop_s:
            await self.instances.deregister(record.instance_id)
            self.events.append((self.clock(), f"gone {record.instance_id}"))
        elif (record.state is InstanceState.STARTING and waited_s >= self.start_s
              and record.version not in self.never_ready):
            await self.instances.heartbeat(record.instance_id, state=InstanceState.READY)
            self.events.append((self.clock(), f"ready {record.instance_id}"))
        else:
            await self.instances.heartbeat(record.instance_id)  # alive

    def _note(self, instance_id: str, what: str) -> None:
        self._since[instance_id] = self.clock()
        self.events.append((self.clock(), f"{what} {instance_id}"))


class World:
    """Model `m` with versions v1, v2, v3; v1 live on 2 READY instances (after `create`)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock or ManualClock(1000.0)  # time.time: real time, for `run_launcher`
        self.models = create_model_registry("memory://", clock=self.clock)
        self.instances = create_registry("memory://", ttl_s=5.0, clock=self.clock)
        self.launcher = FakeLauncher(self.models, self.instances, self.clock)
        self.health: dict[str, VersionHealth] = {}  # version -> what the gateways measured
        self.warmed: list[str] = []  # instance ids, one per warm request
        self.broken: set[str] = set()  # versions whose warm request fails
        self.routings: list[tuple[str | None, str | None, float]] = []  # (live, canary, weight)

    @classmethod
    async def create(cls, clock: Callable[[], float] | None = None,
                     launch_s: float = 1.0) -> World:
        """`launch_s`: the launcher's start_s and stop_s."""
        world = cls(clock)
        world.launcher.start_s = world.launcher.stop_s = launch_s
        for version in ("v1", "v2", "v3"):
            await world.models.add_version(ModelVersion("m", version, f"sim:{version}"))
        await world.models.put_deployment(Deployment("m", "v1", 2), expected_revision=0)
        await world.sleep(0.0)  # registered
        await world.sleep(world.launcher.start_s)  # ready
        assert await world.ready_ids("v1") == ["m-v1-0", "m-v1-1"]
        await world.models.set_routing(ModelRouting("m", live="v1"), expected_revision=0)
        world.launcher.events.clear()
        world.routings.clear()
        return world

    def controller(self, owner: str, models: Any = None, **kwargs: Any) -> ReleaseController:
        """A controller named `owner` in this world (`models`: a view of the model registry)."""
        kwargs = {"health": self.health_of, "config": CONFIG, **kwargs}
        return ReleaseController(models or self.models, self.instances, owner=owner,
                                 warm=self.warm, clock=self.clock, sleep=self.sleep, **kwargs)

    async def sleep(self, seconds: float) -> None:
        if isinstance(self.clock, ManualClock):
            self.clock.now += seconds
        else:
            await asyncio.sleep(seconds)
        await self.launcher.reconcile()
        routing = await self.models.get_routing("m")
        if routing is not None:
            self.routings.append((routing.live, routing.canary, routing.canary_weight))
        await asyncio.sleep(0)  # let other tasks (a second controller) run

    async def warm(self, record: InstanceRecord) -> None:
        self.warmed.append(record.instance_id)
        if record.version in self.broken:
            raise RuntimeError(f"{record.version} is broken")

    async def health_of(self, name: str, version: str) -> VersionHealth:
        """What the gateways measured, for a version that has had traffic (live or canary when
        time last moved)."""
        live, canary, _ = self.routings[-1] if self.routings else (None, None, 0.0)
        if version not in (live, canary):
            return VersionHealth(0, 0, None)
        return self.health.get(version, VersionHealth(0, 0, None))

    async def ready_ids(self, version: str) -> list[str]:
        return [r.instance_id for r in await self.instances.list_instances()
                if r.version == version and r.state is InstanceState.READY]

    async def deployments(self) -> list[tuple[str, int, str]]:
        return [(d.version, d.replicas, d.state.value)
                for d in await self.models.list_deployments()]

    async def routing(self) -> tuple[str | None, str | None, str | None]:
        routing = await self.models.get_routing("m")
        assert routing is not None
        return routing.live, routing.previous, routing.canary

    async def wait_for(self, release_id: str, state: ReleaseState) -> Release:
        """Yield to a background driver until the stored release is in `state`."""
        for _ in range(10_000):
            release = await self.models.get_release(release_id)
            if release is not None and release.state is state:
                return release
            await asyncio.sleep(0)
        raise AssertionError(f"release {release_id} never reached {state}")


def states(release: Release) -> list[str]:
    return [state for state, _ in release.history]


__all__ = ["CONFIG", "FakeLauncher", "World", "states"]
