"""The steps of a LoRA adapter's release: the same Release record, lease and state machine as a
model's (controller.py), but nothing starts or stops: the base model's instances stay up, and
the new adapter version is loaded into them beside the old one, then the old one is unloaded.

An adapter version `name@version` (a ModelVersion with `base`) is loaded on an instance under
that very name, with its registered sha256, so the instance refuses other files and a request
for `name@version` can only ever run on those weights (strata/server/loras.py). The gateway
sends a request for `name` to the live version's name (strata/gateway/path/adapters.py).

    pending       -> starting
    starting      load name@to on every READY instance of the base's live version (the
                  targets), then wait until each one's heartbeat lists it, and propagation_s
                  more (every gateway's view of the instances has it before the flip: a first
                  release has no previous version to fall back on); a load refused (files that
                  do not match, an adapter that does not fit the base) or none listed by
                  ready_timeout_s rolls back
    warming       one real request for name@to to each target (retried), else roll back
    canary        routing.canary := to at its weight for canary_window_s; rolled back when a
                  target stops listing it (restarted, or it was unloaded)
    flipping      routing.live := to (previous := from): one atomic write, as for a model
    retiring      propagation_s after the flip, name@from is unloaded from every instance of
                  the base (requests in flight on it finish first: loras.py), then done
    rolling_back  before the flip: the canary cleared, name@to unloaded. After it: name@from
                  loaded again on every target and warmed, live flipped back, then name@to
                  unloaded (as for a model, with loads in place of instances)

`AdapterFleet` is what the steps do to an instance (load, unload, warm); the gateway gives one
that calls the instance's admin routes with the fleet's key (gateway/control/adapters.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from strata.clock import Clock
from strata.errors import ModelNotFoundError
from strata.registry.instances.base import Registry
from strata.registry.instances.records import InstanceRecord, InstanceState
from strata.registry.models.base import (
    ModelRegistry,
    ModelVersion,
    Release,
    ReleaseState,
    Strategy,
)
from strata.registry.releases.policy import ReleaseConfig
from strata.registry.releases.steps import ReleaseSteps

S = ReleaseState


class AdapterFleet(Protocol):
    """What an adapter release does to one instance; each raises (with a message that says
    why) when the instance refuses or cannot be reached."""

    async def load(self, record: InstanceRecord, lora_name: str, path: str,
                   sha256: str) -> None:
        """Serve the adapter files at `path` as `lora_name`; refused unless they have `sha256`.
        Loading the same files again changes nothing."""
        ...

    async def unload(self, record: InstanceRecord, lora_name: str) -> None:
        """Stop serving `lora_name` (requests in flight finish); a name not served is fine."""
        ...

    async def warm(self, record: InstanceRecord, lora_name: str) -> None:
        """One real request for `lora_name`, straight to the instance."""
        ...


def adapter_path(uri: str) -> str:
    """The directory an instance reads an adapter version from (a path or file://)."""
    return uri.removeprefix("file://")


def lists(record: InstanceRecord, lora_name: str) -> bool:
    """Whether the instance's last heartbeat lists `lora_name` among its adapters."""
    return any(adapter.name == lora_name for adapter in record.load.adapters)


async def base_targets(models: ModelRegistry, instances: Registry,
                       base: str) -> list[InstanceRecord]:
    """The READY instances of `base`'s live version (of any version when it has no routing)."""
    routing = await models.get_routing(base)
    live = routing.live if routing is not None else None
    return [r for r in await instances.list_instances()
            if r.model == base and r.state is InstanceState.READY
            and (live is None or r.version == live)]


class AdapterSteps(ReleaseSteps):
    """The handlers of an adapter release (see the module); `_flip`, the canary's window,
    `_retire_old` and `_roll_back` are a model's, over the loads below."""

    def __init__(self, models: ModelRegistry, instances: Registry, *, owner: str,
                 fleet: AdapterFleet, config: ReleaseConfig, clock: Clock,
                 sleep: Callable[[float], Awaitable[None]]) -> None:
        super().__init__(models, instances, owner=owner, warm=_no_model_warm, health=None,
                         config=config, clock=clock, sleep=sleep)
        self.fleet = fleet
        self.instances = instances

    async def _deploy(self, release: Release) -> Release:
        return await self._move(release, S.STARTING)

    async def _await_ready(self, release: Release) -> Release:
        deadline = self._entered(release, S.STARTING) + self.config.ready_timeout_s
        release, failure = await self._load_everywhere(release, release.to_version, deadline)
        if failure:
            return await self._move(release, S.ROLLING_BACK, failure)
        return await self._move(release, S.WARMING)

    async def _warm_up(self, release: Release) -> Release:
        release, failure = await self._warm_everywhere(release, release.to_version)
        if failure:
            return await self._move(release, S.ROLLING_BACK, failure)
        following = S.CANARY if release.strategy is Strategy.CANARY else S.FLIPPING
        return await self._move(release, following, stats={"ready_at": self.clock()})

    async def _canary_lost(self, release: Release) -> str:
        key = f"{release.name}@{release.to_version}"
        targets = await base_targets(self.models, self.instances, release.base)
        lost = [r.instance_id for r in targets if not lists(r, key)]
        return (f"canary {key}: no longer loaded on {', '.join(lost)} (an instance restarted "
                "or the adapter was unloaded)") if lost else ""

    async def _retire(self, release: Release, version: str,
                      deadline: float) -> tuple[Release, str]:
        """Unload name@version from every instance of the base, then wait until none lists it;
        "" or a note."""
        key = f"{release.name}@{version}"
        holders = [r for r in await self.instances.list_instances()
                   if r.model == release.base and r.state is not InstanceState.DEAD]
        release, failure = await self._all(release, [self._unload_one(r, key) for r in holders])

        async def gone() -> bool:
            return not any(lists(r, key) for r in await self.instances.list_instances()
                           if r.state is not InstanceState.DEAD)

        release, is_gone = await self._wait(release, gone, deadline)
        if is_gone and not failure:
            return release, ""
        return release, failure or (f"{key} still listed by an instance after "
                                    f"retire_timeout_s={self.config.retire_timeout_s}")

    async def _flip_back(self, release: Release, old: str) -> tuple[Release, str]:
        """name@old loaded and warmed on every target again, then live flipped back to it."""
        deadline = self._entered(release, S.ROLLING_BACK) + self.config.ready_timeout_s
        release, failure = await self._load_everywhere(release, old, deadline)
        if not failure:
            release, failure = await self._warm_everywhere(release, old)
        if failure:
            return release, (f"rollback failed: {failure}; {release.name}@"
                             f"{release.to_version} stays live")
        return await self._flip_live_back(release, old), ""

    # --- loads ----------------------------------------------------------------------------------

    async def _load_everywhere(self, release: Release, version: str,
                               deadline: float) -> tuple[Release, str]:
        """name@version loaded on every target and listed by each one's heartbeat; "" or why
        not."""
        record = await self._version(release, version)
        targets = await base_targets(self.models, self.instances, release.base)
        if not targets:
            return release, f"no ready instance of {release.base} to load {record.key} on"
        release, failure = await self._all(release, [self._load_one(r, record)
                                                     for r in targets])
        if failure:
            return release, failure
        wanted = {r.instance_id for r in targets}

        async def listed() -> bool:
            return all(lists(r, record.key) for r in await self.instances.list_instances()
                       if r.instance_id in wanted)

        release, is_listed = await self._wait(release, listed, deadline)
        if not is_listed:
            return release, (f"{record.key} not listed by every instance of {release.base} "
                             f"after ready_timeout_s={self.config.ready_timeout_s}")
        seen_at = self.clock() + self.config.propagation_s  # every gateway's view has it
        while self.clock() < seen_at:
            release = await self._tick(release, min(self.config.poll_s, seen_at - self.clock()))
        return release, ""

    async def _warm_everywhere(self, release: Release, version: str) -> tuple[Release, str]:
        key = f"{release.name}@{version}"
        targets = [r for r in await base_targets(self.models, self.instances, release.base)
                   if lists(r, key)]
        if not targets:
            return release, f"no ready instance of {release.base} lists {key}"

        async def warm(record: InstanceRecord) -> None:
            await self.fleet.warm(record, key)
        return await self._warm_all(release, targets, warm)

    async def _load_one(self, record: InstanceRecord, version: ModelVersion) -> str:
        try:
            await self.fleet.load(record, version.key, adapter_path(version.uri),
                                  version.manifest_sha256)
            return ""
        except Exception as exc:  # the instance's refusal, or it could not be reached
            return f"loading {version.key} on instance {record.instance_id} failed: {exc}"

    async def _unload_one(self, record: InstanceRecord, lora_name: str) -> str:
        try:
            await self.fleet.unload(record, lora_name)
            return ""
        except Exception as exc:
            return f"unloading {lora_name} from instance {record.instance_id} failed: {exc}"

    async def _version(self, release: Release, version: str) -> ModelVersion:
        record = await self.models.get_version(release.name, version)
        if record is None:
            raise ModelNotFoundError(f"adapter version {release.name}@{version} is not "
                                     "registered")
        return record


async def _no_model_warm(record: InstanceRecord) -> None:
    raise AssertionError("an adapter release warms through its AdapterFleet")


__all__ = ["AdapterFleet", "AdapterSteps", "adapter_path", "base_targets", "lists"]
