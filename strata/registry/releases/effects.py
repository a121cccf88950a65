"""What release steps read and write besides the release record: the instances of a version,
its deployment (the desired instances a launcher reconciles) and the model's routing pointer.
Every write is idempotent and, when it loses a compare-and-set, decides again from what it
reads, so a step can run it twice (a resumed release) and racing writers converge.

    ReleaseEffects.instances(name, version, state)            name@version's instances
    ReleaseEffects.put_deployment(name, version, state, n)    that deployment, in that state
    ReleaseEffects.update_routing(name, change)               the routing, changed by CAS
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from strata.errors import ConflictError
from strata.registry.instances.base import Registry
from strata.registry.instances.records import InstanceRecord, InstanceState
from strata.registry.models.base import (
    Deployment,
    DeploymentState,
    ModelRegistry,
    ModelRouting,
    PoolSize,
)


class ReleaseEffects:
    """The registries a release controller acts through."""

    def __init__(self, models: ModelRegistry, instances: Registry) -> None:
        self.models = models
        self.registry = instances

    async def instances(self, name: str, version: str,
                        state: InstanceState | None = None) -> list[InstanceRecord]:
        """name@version's instances in `state` (None: any but DEAD, whose heartbeat stopped)."""
        return [r for r in await self.registry.list_instances()
                if r.model == name and r.version == version
                and (r.state is state if state is not None else r.state is not InstanceState.DEAD)]

    async def deployment(self, name: str, version: str) -> Deployment | None:
        return next((d for d in await self.models.list_deployments()
                     if d.name == name and d.version == version), None)

    async def put_deployment(self, name: str, version: str, state: DeploymentState,
                             replicas: int | None) -> None:
        """Make name@version's deployment `state` (replicas None: keep them). Idempotent; a
        RETIRING one that is already gone (the launcher deletes it) is not brought back."""
        while True:
            current = await self.deployment(name, version)
            if current is None:
                if state is DeploymentState.RETIRING and not await self.instances(name, version):
                    return
                size = replicas or 0
                wanted = Deployment(name, version, size, state,
                                    pools=await self._pools_like(name, size))
                expected = 0
            else:
                kept = replicas is None or replicas == current.replicas
                wanted = replace(current if kept else current.resized(replicas or 0),
                                 state=state)  # a resized one becomes one mixed pool
                if wanted == current:
                    return
                expected = current.revision
            try:
                await self.models.put_deployment(wanted, expected_revision=expected)
                return
            except ConflictError:
                continue  # a launcher or another controller wrote it: decide again

    async def _pools_like(self, name: str, replicas: int) -> tuple[PoolSize, ...]:
        """The pools of the model's active deployment of the same size (the version a release
        replaces), so that a new version is laid out like it: its prefill, decode and class
        pools carry over; () when there is none (one mixed pool)."""
        return next((d.pools for d in await self.models.list_deployments()
                     if d.name == name and d.replicas == replicas
                     and d.state is DeploymentState.ACTIVE), ())

    async def update_routing(self, name: str, change: Callable[[ModelRouting],
                             ModelRouting | None]) -> tuple[ModelRouting, bool]:
        """Apply `change` (None: nothing to do) by CAS, re-reading on conflict; the routing as
        stored and whether this call wrote it."""
        while True:
            current = await self.models.get_routing(name) or ModelRouting(name=name)
            wanted = change(current)
            if wanted is None:
                return current, False
            try:
                return await self.models.set_routing(wanted,
                                                     expected_revision=current.revision), True
            except ConflictError:
                continue


__all__ = ["ReleaseEffects"]
