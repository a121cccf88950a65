"""The release controller: drives a Release through its state machine, one CAS write a step.

    start(name, version)    validate and store a PENDING release (leased to this controller)
    drive(release_id)       take the lease and run the release to a terminal state
    request_rollback(name)  roll back the release in progress, or release `previous` again
    resumable()             releases whose controller stopped renewing its lease

A finished release is kept (its history and reason) among the newest `keep_releases` of its
model; older ones are deleted when another finishes, so the list every dashboard reads stays
short.

Each state names the step in progress; its handler does that step idempotently (it first
checks what is already done), then moves on with one compare-and-set write of the release:

    pending ──> starting ──> warming ──┬──────────────────> flipping ──> retiring ──> done
       │           │            │      └──> canary ──┬──────────^   │          │
       │           │            │                    │              │          │
       └───────────┴────────────┴────────────────────┴──────────────┴──────────┘
                                      │       (after the flip: only on request_rollback)
                                      v
                               rolling_back ──> rolled_back

    pending       write name@to's deployment ACTIVE with `replicas`
    starting      wait until `replicas` instances of name@to are READY (ready_timeout_s)
    warming       one real request to each (`warm`, retried); stats["ready_at"]
    canary        routing.canary := to at canary_weight, judged every poll for canary_window_s
    flipping      routing.live := to (previous := from, canary cleared): one atomic write;
                  at consistency strict, then wait until every gateway's routing view carries
                  it or that gateway fenced itself (flip_acks.py; stats["flip_acked_s"])
    retiring      propagation_s after the flip, name@from's deployment RETIRING; wait until
                  its instances are gone (retire_timeout_s, then done with a note)
    rolling_back  after a ready timeout, a failed warm, a bad canary or request_rollback
                  before the flip: the canary cleared (live stays `from`), name@to RETIRING,
                  wait until its instances are gone. After the flip (request_rollback while
                  flipping or retiring): first name@from ACTIVE again, its instances READY
                  (started anew where they had drained) and warmed, live flipped back to it
                  (previous := to); then name@to retires the same way
    failed        terminal: the routing pointer contradicts the release (changed outside it),
                  or a rollback after the flip could not bring name@from back (to stays live)

A release is driven by one controller at a time, the lease holder (`owner`, `lease_until`):
every write renews the lease, and a waiting step renews it every poll. A write that loses its
CAS re-reads the record: another controller's request (a rollback) is continued from the
stored state; a record taken by another owner stops this driver. Because every step checks
what is done before acting, a controller that crashes in any state leaves a record that any
other controller resumes (`resumable`, then `drive`) to the same terminal state.

A LoRA adapter's version (a ModelVersion with `base`) is released through the same record,
lease and states, but by loading it into the base's running instances instead of starting new
ones (adapter_steps.py): the controller needs an `AdapterFleet` for that.

Every effect goes through the registries, the injected `warm` or the injected `adapters`; no
HTTP or processes here.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable

from strata.clock import Clock
from strata.errors import (
    ConfigError,
    ConflictError,
    InvalidRequestError,
    ModelNotFoundError,
    ReleaseSupersededError,
)
from strata.registry.instances.base import Registry
from strata.registry.models.base import ModelRegistry, Release, ReleaseState, Strategy
from strata.registry.releases.adapter_steps import AdapterFleet, AdapterSteps, base_targets
from strata.registry.releases.policy import (
    HealthOf,
    ReleaseConfig,
    VersionHealth,
    Warm,
    judge_canary,
)
from strata.registry.releases.steps import ReleaseSteps

S = ReleaseState
ROLLBACK_REQUESTED = "rollback requested"
BEFORE_FLIP = (S.PENDING, S.STARTING, S.WARMING, S.CANARY)


class ReleaseController:
    """Starts, drives, rolls back and resumes releases; one per gateway process, `owner` unique."""

    def __init__(self, models: ModelRegistry, instances: Registry, *, owner: str, warm: Warm,
                 health: HealthOf | None = None, config: ReleaseConfig | None = None,
                 clock: Clock = time.time,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 adapters: AdapterFleet | None = None) -> None:
        if not owner:
            raise ConfigError("a release controller needs a non-empty owner (unique per "
                              "controller, e.g. the gateway's host:port)")
        self.models = models
        self.owner = owner
        self.health = health
        self.config = config or ReleaseConfig()
        self.clock = clock
        self.instances = instances
        self._steps = ReleaseSteps(models, instances, owner=owner, warm=warm, health=health,
                                   config=self.config, clock=clock, sleep=sleep)
        self._adapter_steps = None if adapters is None else AdapterSteps(
            models, instances, owner=owner, fleet=adapters, config=self.config, clock=clock,
            sleep=sleep)
        self._driving: set[str] = set()  # release ids a drive() of this controller runs

    async def start(self, name: str, version: str, *, strategy: Strategy = Strategy.BLUE_GREEN,
                    canary_weight: float = 0.1, replicas: int | None = None) -> Release:
        """Store a PENDING release of name@version (leased to this controller: drive it next)."""
        live = await self._check_startable(name, version, strategy, canary_weight)
        base = await self._adapter_base(name, version)
        if base:
            replicas = await self._adapter_targets(name, version, base)
        elif replicas is None:
            replicas = await self._live_replicas(name, live)
        if replicas < 1:
            raise InvalidRequestError(f"replicas must be >= 1, got {replicas}")
        now = self.clock()
        release = Release(
            release_id=f"{name}-{version}-{secrets.token_hex(3)}", name=name,
            to_version=version, from_version=live, strategy=strategy,
            canary_weight=canary_weight, replicas=replicas,
            history=((S.PENDING.value, now),), owner=self.owner,
            lease_until=now + self.config.lease_s, created_at=now, updated_at=now, base=base)
        try:
            return await self.models.put_release(release, expected_revision=0)
        except ConflictError:
            raise await self._in_progress_error(name) from None

    async def drive(self, release_id: str) -> Release:
        """Take the lease and run the release to a terminal state; the final (or, when another
        owner took it over, the last seen) record. ConflictError while another owner's lease
        is live."""
        if release_id in self._driving:
            raise ConflictError(f"release {release_id} is already being driven by this "
                                f"controller ({self.owner})")
        self._driving.add(release_id)
        try:
            release = await self._acquire(release_id)
            while not release.is_terminal:
                try:
                    release = await self._steps_of(release).step(release)
                except ReleaseSupersededError as changed:
                    release = changed.release
                    if release.owner != self.owner:
                        return release  # another controller took it over
            await self.models.prune_releases(release.name, keep=self.config.keep_releases)
            return release
        finally:
            self._driving.discard(release_id)

    async def request_rollback(self, name: str) -> Release:
        """Roll back `name`: the release in progress (its driver continues from ROLLING_BACK;
        past the flip, that flips live back once the old version serves again), else a new
        blue-green release of the previous version."""
        while True:
            current = await self._in_progress(name)
            if current is None:
                break
            if current.state is S.ROLLING_BACK:
                return current
            if current.from_version is None and current.state not in BEFORE_FLIP:
                raise InvalidRequestError(
                    f"release {current.release_id} is the first of {name}: {current.to_version} "
                    "is live and there is no earlier version to roll back to")
            moved = current.moved_to(S.ROLLING_BACK, self.clock(), ROLLBACK_REQUESTED)
            try:  # owner and lease stay: the driver (or a resumer) continues from here
                return await self.models.put_release(moved, expected_revision=current.revision)
            except ConflictError:
                continue  # the driver moved it meanwhile: judge the new state
        routing = await self.models.get_routing(name)
        if routing is None or routing.previous is None:
            raise InvalidRequestError(f"model {name!r} has no previous version to roll back "
                                      "to; release a version explicitly")
        return await self.start(name, routing.previous, strategy=Strategy.BLUE_GREEN)

    async def resumable(self) -> list[Release]:
        """Non-terminal releases whose lease expired (their controller stopped): drive them."""
        now = self.clock()
        return [r for r in await self.models.list_releases()
                if not r.is_terminal and r.lease_until <= now
                and r.release_id not in self._driving]

    # --- internals ----------------------------------------------------------------------------

    def _steps_of(self, release: Release) -> ReleaseSteps:
        if not release.is_adapter:
            return self._steps
        if self._adapter_steps is None:
            raise ConfigError(f"release {release.release_id} is of a LoRA adapter and this "
                              "controller has no AdapterFleet to load it with")
        return self._adapter_steps

    async def _adapter_base(self, name: str, version: str) -> str:
        """The base model of name@version when it is an adapter version, else ""."""
        record = await self.models.get_version(name, version)
        if record is None or not record.is_adapter:
            return ""
        if self._adapter_steps is None:
            raise InvalidRequestError(f"{name}@{version} is a LoRA adapter version and this "
                                      "controller cannot load adapters")
        return record.base

    async def _adapter_targets(self, name: str, version: str, base: str) -> int:
        """How many instances the adapter version will be loaded on (at least one)."""
        num_targets = len(await base_targets(self.models, self.instances, base))
        if num_targets < 1:
            raise InvalidRequestError(f"{name}@{version} is an adapter of {base!r}, which has "
                                      "no ready instance to load it on; start one first")
        return num_targets

    async def _acquire(self, release_id: str) -> Release:
        while True:
            release = await self.models.get_release(release_id)
            if release is None:
                raise ModelNotFoundError(f"no release {release_id!r}; list the releases of "
                                         "the model to find its id")
            if release.is_terminal:
                return release
            if release.owner not in ("", self.owner) and release.lease_until > self.clock():
                raise ConflictError(
                    f"release {release_id} is driven by {release.owner!r} (lease until "
                    f"{release.lease_until:.1f}); it can be resumed once that lease expires")
            try:
                return await self._steps.write(release)
            except ReleaseSupersededError:
                continue

    async def _check_startable(self, name: str, version: str, strategy: Strategy,
                               canary_weight: float) -> str | None:
        """The live version, after checking that name@version may be released now."""
        known = [v.version for v in await self.models.list_versions(name)]
        if version not in known:
            raise ModelNotFoundError(
                f"no version {name}@{version}; known versions of {name!r}: "
                f"{', '.join(known) or 'none'} (add it with `strata models add "
                f"{name}@{version} URI`)")
        routing = await self.models.get_routing(name)
        live = routing.live if routing is not None else None
        if live == version:
            raise InvalidRequestError(f"{name}@{version} is already live; nothing to release")
        if strategy is Strategy.CANARY:  # an adapter's canary is watched by its loads alone
            is_adapter = bool(await self._adapter_base(name, version))
            _check_canary(name, live, canary_weight,
                          has_health=self.health is not None or is_adapter)
        if await self._in_progress(name) is not None:
            raise await self._in_progress_error(name)
        return live

    async def _live_replicas(self, name: str, live: str | None) -> int:
        for deployment in await self.models.list_deployments():
            if deployment.name == name and deployment.version == live:
                return max(deployment.replicas, 1)
        return 1

    async def _in_progress(self, name: str) -> Release | None:
        running = [r for r in await self.models.list_releases(name) if not r.is_terminal]
        return running[-1] if running else None

    async def _in_progress_error(self, name: str) -> ConflictError:
        running = await self._in_progress(name)
        which = "" if running is None else (
            f": {running.release_id} ({running.from_version} -> {running.to_version}, "
            f"{running.state})")
        return ConflictError(f"model {name!r} already has a release in progress{which}; wait "
                             f"for it to finish or roll it back with `strata rollback {name}`")


def _check_canary(name: str, live: str | None, weight: float, *, has_health: bool) -> None:
    if live is None:
        raise InvalidRequestError(f"model {name!r} has no live version to compare a canary "
                                  "with; use --strategy blue-green for its first release")
    if not 0.0 < weight < 1.0:
        raise InvalidRequestError(f"canary weight must be in (0, 1), got {weight}")
    if not has_health:
        raise InvalidRequestError("this controller has no health source to watch a canary; "
                                  "use --strategy blue-green")


__all__ = ["HealthOf", "ReleaseConfig", "ReleaseController", "VersionHealth", "Warm",
           "judge_canary"]
