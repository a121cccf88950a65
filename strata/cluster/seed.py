"""What `strata up` writes into the registry before it starts anything.

A cluster owns its registry, but not all of it is per-run state:

    kept           the model catalogue (every name@version ever added: `strata models list`
                   after a restart still shows them, and `strata release` can use them)
    re-seeded      instance records (all deregistered), deployments (all deleted, then one
                   ACTIVE deployment of the flags' name@version), routing (that model's `live`
                   pointer set to it; any other model's live and canary pointers cleared)
    closed         releases left unfinished by the previous run: FAILED, "cluster restarted"

So a restarted cluster serves what its flags say, and never resumes half a release whose
instances died with the previous run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from strata.errors import ConfigError, ConflictError
from strata.registry import Registry
from strata.registry.models import (
    Deployment,
    ModelRegistry,
    ModelRouting,
    ModelVersion,
    PoolSize,
    ReleaseState,
)

log = logging.getLogger("strata.up")
RESTART_REASON = "cluster restarted"


@dataclass(frozen=True, slots=True)
class ClusterSeed:
    """`replicas` instances of `version`, which is the model's live version (in `pools`,
    when it has some: `strata up --prefill N --decode M`)."""

    version: ModelVersion
    replicas: int
    pools: tuple[PoolSize, ...] = ()

    def __post_init__(self) -> None:
        if self.replicas < 0:  # 0: an autoscaler starts the first one when a request comes
            raise ConfigError(f"--replicas must be >= 0, got {self.replicas}")


async def seed_registry(models: ModelRegistry, instances: Registry, seed: ClusterSeed, *,
                        now: float | None = None) -> ModelVersion:
    """Reset the per-run state (module docstring), then deploy and route `seed`. Returns the
    catalogue's record of the version (an identical earlier one keeps its created_at)."""
    now = time.time() if now is None else now
    version = await add_or_reuse(models, seed.version)
    await _forget_run_state(models, instances, now, keep_routing_of=version.name)
    await models.put_deployment(Deployment(version.name, version.version, seed.replicas,
                                           pools=seed.pools), expected_revision=0)
    await _point_live(models, version)
    return version


async def add_or_reuse(models: ModelRegistry, version: ModelVersion) -> ModelVersion:
    """Add `version` to the catalogue; the same record already there is fine, another one under
    the same name@version is a mistake the user fixes by choosing another version."""
    try:
        return await models.add_version(version)
    except ConflictError:
        stored = await models.get_version(version.name, version.version)
        held = f"uri {stored.uri!r}" if stored is not None else "another record"
        raise ConfigError(
            f"{version.key} is already in the model catalogue with {held}, not "
            f"uri {version.uri!r}; versions are immutable: pick another --model-version "
            f"(e.g. {version.name}@{version.version}-2), or serve the registered one"
        ) from None


async def _forget_run_state(models: ModelRegistry, instances: Registry, now: float, *,
                            keep_routing_of: str) -> None:
    for record in await instances.list_instances():
        await instances.deregister(record.instance_id)
    for deployment in await models.list_deployments():
        await models.delete_deployment(deployment.name, deployment.version)
    for release in await models.list_releases():
        if not release.is_terminal:
            failed = replace(release.moved_to(ReleaseState.FAILED, now, RESTART_REASON),
                             owner="", lease_until=0.0)
            await models.put_release(failed, expected_revision=release.revision)
            log.warning("release %s of %s was unfinished: marked failed (%s)",
                        release.release_id, release.name, RESTART_REASON)
    adapters = {v.name for v in await models.list_versions() if v.is_adapter}
    for routing in await models.list_routing():  # adapters stay live: the gateways load them
        if routing.name in adapters:              # on the new instances (AdapterSync)
            continue
        if routing.name != keep_routing_of and (routing.live or routing.canary):
            cleared = replace(routing, live=None, canary=None, canary_weight=0.0)
            await models.set_routing(cleared, expected_revision=routing.revision)


async def _point_live(models: ModelRegistry, version: ModelVersion) -> ModelRouting:
    routing = await models.get_routing(version.name)
    if routing is None:
        return await models.set_routing(ModelRouting(version.name, live=version.version),
                                        expected_revision=0)
    return await models.set_routing(routing.flipped_to(version.version),
                                    expected_revision=routing.revision)


__all__ = ["RESTART_REASON", "ClusterSeed", "add_or_reuse", "seed_registry"]
