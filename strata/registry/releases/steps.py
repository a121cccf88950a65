"""The steps of a release, one idempotent handler per state (the machine is drawn in releases.py).

    ReleaseSteps     the handlers; every release write renews this controller's lease
    ReleaseSupersededError  the stored release changed under the driver (it re-reads and decides)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

from strata.clock import Clock
from strata.errors import ConflictError, ReleaseSupersededError, StrataError
from strata.registry.instances.base import Registry
from strata.registry.instances.records import InstanceRecord, InstanceState
from strata.registry.models.base import (
    DeploymentState,
    ModelRegistry,
    Release,
    ReleaseState,
    Strategy,
)
from strata.registry.releases.effects import ReleaseEffects
from strata.registry.releases.flip_acks import FlipWatch
from strata.registry.releases.policy import HealthOf, ReleaseConfig, Warm, judge_canary

S = ReleaseState
WARM_ATTEMPTS = 3  # a warm request that fails this many times in a row rolls the release back


class ReleaseSteps:
    """The handlers of ReleaseController.drive; each takes the release as stored (leased to this
    controller) and returns it as stored after its transition."""

    def __init__(self, models: ModelRegistry, instances: Registry, *, owner: str, warm: Warm,
                 health: HealthOf | None, config: ReleaseConfig, clock: Clock,
                 sleep: Callable[[float], Awaitable[None]]) -> None:
        self.models, self.owner = models, owner
        self.effects = ReleaseEffects(models, instances)
        self.warm, self.health, self.config = warm, health, config
        self.clock, self.sleep = clock, sleep

    async def step(self, release: Release) -> Release:
        handlers = {S.PENDING: self._deploy, S.STARTING: self._await_ready,
                    S.WARMING: self._warm_up, S.CANARY: self._watch_canary,
                    S.FLIPPING: self._flip, S.RETIRING: self._retire_old,
                    S.ROLLING_BACK: self._roll_back}
        return await handlers[release.state](release)

    async def write(self, release: Release) -> Release:
        """Store `release` (read at its `revision`) with this controller's lease renewed."""
        new = replace(release, owner=self.owner,
                      lease_until=self.clock() + self.config.lease_s)
        try:
            return await self.models.put_release(new, expected_revision=release.revision)
        except ConflictError:
            stored = await self.models.get_release(release.release_id)
            if stored is None or stored.revision == release.revision:
                raise  # not a lost race: the registry refused the record itself
            raise ReleaseSupersededError(stored) from None

    # --- the handlers, one per state ------------------------------------------------------------

    async def _deploy(self, release: Release) -> Release:
        await self.effects.put_deployment(release.name, release.to_version, DeploymentState.ACTIVE,
                                   release.replicas)
        return await self._move(release, S.STARTING)

    async def _await_ready(self, release: Release) -> Release:
        release, not_ready = await self._wait_new_ready(release)
        if not_ready:
            return await self._move(release, S.ROLLING_BACK, not_ready)
        return await self._move(release, S.WARMING)

    async def _warm_up(self, release: Release) -> Release:
        release, not_ready = await self._wait_new_ready(release)  # again: one may have died
        if not_ready:
            return await self._move(release, S.ROLLING_BACK, not_ready)
        ready = await self.effects.instances(release.name, release.to_version,
                                             InstanceState.READY)
        release, failure = await self._warm_all(release, ready)
        if failure:
            return await self._move(release, S.ROLLING_BACK, failure)
        following = S.CANARY if release.strategy is Strategy.CANARY else S.FLIPPING
        return await self._move(release, following, stats={"ready_at": self.clock()})

    async def _watch_canary(self, release: Release) -> Release:
        to, weight = release.to_version, release.canary_weight
        await self.effects.update_routing(release.name, lambda r: None if (
            r.canary == to and r.canary_weight == weight) else replace(
            r, canary=to, canary_weight=weight))
        window_end = self._entered(release, S.CANARY) + self.config.canary_window_s
        while True:
            verdict = await self._canary_lost(release) or await self._judge(release)
            if verdict:
                return await self._move(release, S.ROLLING_BACK, verdict)
            if self.clock() >= window_end:
                return await self._move(release, S.FLIPPING)
            release = await self._tick(release)

    async def _flip(self, release: Release) -> Release:
        to = release.to_version
        routing, wrote = await self.effects.update_routing(
            release.name, lambda r: None if r.live == to else r.flipped_to(to))
        flipped_at = self.clock() if wrote else routing.updated_at
        stats = {"flipped_at": flipped_at}
        if "ready_at" in release.stats:
            stats["ready_to_flip_s"] = flipped_at - release.stats["ready_at"]
        if self.config.consistency == "strict":
            release, acked = await self._await_acks(release, routing.revision)
            stats.update(acked)
        return await self._move(release, S.RETIRING, stats=stats)

    async def _await_acks(self, release: Release,
                          revision: int) -> tuple[Release, dict[str, float]]:
        """Wait until every gateway acknowledged routing `revision` or fenced itself
        (flip_acks.py); the wait's stats. A resumed release waits again: a view acked once
        stays acked, and a silent one is timed anew from this driver's first reading."""
        watch = FlipWatch(release.name, revision, self.clock)
        started = self.clock()
        while not (acks := watch.judge(await self.models.list_views())).is_done:
            release = await self._tick(release, self.config.poll_s / 4)
        return release, {"flip_acked_s": self.clock() - started,
                         "gateways_acked": float(len(acks.acked)),
                         "gateways_fenced": float(len(acks.fenced)),
                         "gateways_unfenced": float(len(acks.unfenced))}

    async def _retire_old(self, release: Release) -> Release:
        routing = await self.models.get_routing(release.name)
        live = routing.live if routing is not None else None
        if live != release.to_version:
            return await self._move(release, S.FAILED, (
                f"live is {live}, not {release.to_version}: the routing changed outside this "
                f"release; {release.from_version} was not retired"))
        if release.from_version is None:  # the model's first release: nothing to retire
            return await self._move(release, S.DONE)
        old = release.from_version
        flipped_at = release.stats.get("flipped_at", self._entered(release, S.RETIRING))
        retire_at = flipped_at + self.config.propagation_s  # every gateway has seen the flip
        while self.clock() < retire_at:
            release = await self._tick(release, min(self.config.poll_s, retire_at - self.clock()))
        release, note = await self._retire(release, old, retire_at + self.config.retire_timeout_s)
        return await self._move(release, S.DONE, note)

    async def _roll_back(self, release: Release) -> Release:
        to, old = release.to_version, release.from_version
        routing = await self.models.get_routing(release.name)
        if routing is not None and routing.live == to:
            if old is None or not _has_flipped(release):
                return await self._move(release, S.FAILED, (
                    f"{release.name}@{to} is live (the routing changed outside this release); "
                    "it was not rolled back"))
            release, failure = await self._flip_back(release, old)
            if failure:
                return await self._move(release, S.FAILED, failure)
        await self.effects.update_routing(release.name, lambda r: None if r.canary != to else
                                          replace(r, canary=None, canary_weight=0.0))
        since = release.stats.get("flipped_back_at", self._entered(release, S.ROLLING_BACK))
        release, note = await self._retire(release, to, since + self.config.retire_timeout_s)
        return await self._move(release, S.ROLLED_BACK,
                                f"{release.reason}; {note}" if note else "")

    async def _flip_back(self, release: Release, old: str) -> tuple[Release, str]:
        """Undo this release's flip: name@old serving again (its deployment ACTIVE, its
        instances READY, started anew where they had drained, and warmed), then live flipped
        back to it. "" or why it could not (name@old retires again; name@to stays live)."""
        name = release.name
        current = await self.effects.deployment(name, old)
        replicas = current.replicas if current is not None and current.replicas else (
            release.replicas)
        await self.effects.put_deployment(name, old, DeploymentState.ACTIVE, replicas)
        deadline = self._entered(release, S.ROLLING_BACK) + self.config.ready_timeout_s
        release, failure = await self._wait_ready(release, old, replicas, deadline)
        if not failure:
            ready = await self.effects.instances(name, old, InstanceState.READY)
            release, failure = await self._warm_all(release, ready)
        if failure:
            await self.effects.put_deployment(name, old, DeploymentState.RETIRING, None)
            return release, (f"rollback failed: {failure}; {name}@{release.to_version} stays "
                             "live")
        return await self._flip_live_back(release, old), ""

    async def _flip_live_back(self, release: Release, old: str) -> Release:
        """Flip live back to `old` in one write (a model's or an adapter's rollback), proven
        like the flip itself under strict."""
        routing, _ = await self.effects.update_routing(
            release.name, lambda r: None if r.live == old else r.flipped_to(old))
        stats = {"flipped_back_at": self.clock()}
        if self.config.consistency == "strict":  # the flip back is a flip: proven the same way
            release, acked = await self._await_acks(release, routing.revision)
            stats["flip_back_acked_s"] = acked["flip_acked_s"]
        return await self.write(replace(release, stats={**release.stats, **stats}))

    # --- shared pieces --------------------------------------------------------------------------

    async def _move(self, release: Release, state: ReleaseState, reason: str = "",
                    stats: dict[str, float] | None = None) -> Release:
        moved = release.moved_to(state, self.clock(), reason)
        if stats:
            moved = replace(moved, stats={**release.stats, **stats})
        return await self.write(moved)

    async def _tick(self, release: Release, seconds: float | None = None) -> Release:
        """Wait one poll, then re-read the release: a newer revision supersedes the step in
        progress; past half the lease, renew it."""
        await self.sleep(self.config.poll_s if seconds is None else seconds)
        stored = await self.models.get_release(release.release_id)
        if stored is None:
            raise StrataError(f"release {release.release_id} was deleted while being driven")
        if stored.revision != release.revision:
            raise ReleaseSupersededError(stored)
        if stored.lease_until - self.clock() < self.config.lease_s / 2:
            return await self.write(stored)
        return stored

    async def _wait(self, release: Release, condition: Callable[[], Awaitable[bool]],
                    deadline: float) -> tuple[Release, bool]:
        while not await condition():
            if self.clock() >= deadline:
                return release, False
            release = await self._tick(release)
        return release, True

    async def _wait_new_ready(self, release: Release) -> tuple[Release, str]:
        deadline = self._entered(release, S.STARTING) + self.config.ready_timeout_s
        return await self._wait_ready(release, release.to_version, release.replicas, deadline)

    async def _wait_ready(self, release: Release, version: str, replicas: int,
                          deadline: float) -> tuple[Release, str]:
        """Wait until `replicas` instances of name@version are READY; "" or why not."""
        async def num_ready() -> int:
            return len(await self.effects.instances(release.name, version, InstanceState.READY))

        async def all_ready() -> bool:
            return await num_ready() >= replicas

        release, is_ready = await self._wait(release, all_ready, deadline)
        return release, "" if is_ready else (
            f"{await num_ready()} of {replicas} instances of {release.name}@{version} ready "
            f"after ready_timeout_s={self.config.ready_timeout_s}")

    async def _warm_all(self, release: Release, records: list[InstanceRecord],
                        warm: Warm | None = None) -> tuple[Release, str]:
        """Warm every record at once with `warm` (default: this controller's) while the lease is
        renewed; "" or the first failure."""
        return await self._all(release, [self._warm_one(record, warm or self.warm)
                                         for record in records])

    async def _all(self, release: Release,
                   calls: list[Awaitable[str]]) -> tuple[Release, str]:
        """Run `calls` (each "" or why it failed) at once, renewing the lease meanwhile; ""
        or the first failure."""
        tasks = [asyncio.ensure_future(call) for call in calls]
        try:
            while not all(task.done() for task in tasks):
                release = await self._tick(release)
        finally:
            for task in tasks:
                task.cancel()
        failures = [task.result() for task in tasks if task.result()]
        return release, (failures[0] if failures else "")

    async def _warm_one(self, record: InstanceRecord, warm: Warm) -> str:
        error = ""
        for attempt in range(WARM_ATTEMPTS):
            if attempt:
                await self.sleep(self.config.poll_s)
            try:
                await warm(record)
                return ""
            except Exception as exc:  # any failure of the real request counts against it
                error = f"{type(exc).__name__}: {exc}"
        return (f"warming {record.model_version} on instance {record.instance_id} failed "
                f"{WARM_ATTEMPTS} times; last: {error}")

    async def _canary_lost(self, release: Release) -> str:
        """Why the canary must roll back because one of its instances stopped serving (it
        died, or its launcher restarted it): the gateways count no request of a version that
        has no instance to take it, so a crashing canary could look merely quiet."""
        ready = await self.effects.instances(release.name, release.to_version,
                                             InstanceState.READY)
        if len(ready) >= release.replicas:
            return ""
        return (f"canary {release.name}@{release.to_version}: {len(ready)} of "
                f"{release.replicas} instances ready during the canary window (an instance "
                "died or was restarted)")

    async def _judge(self, release: Release) -> str:
        if self.health is None or release.from_version is None:
            return ""  # nothing to compare with: the window alone decides
        canary = await self.health(release.name, release.to_version)
        live = await self.health(release.name, release.from_version)
        return judge_canary(release.name, release.to_version, canary, live, self.config)

    async def _retire(self, release: Release, version: str,
                      deadline: float) -> tuple[Release, str]:
        """Mark name@version RETIRING and wait until its instances are gone; "" or a note."""
        await self.effects.put_deployment(release.name, version, DeploymentState.RETIRING, None)

        async def gone() -> bool:
            return not await self.effects.instances(release.name, version)

        release, is_gone = await self._wait(release, gone, deadline)
        if is_gone:
            return release, ""
        left = len(await self.effects.instances(release.name, version))
        return release, (f"{left} instance(s) of {release.name}@{version} still up after "
                         f"retire_timeout_s={self.config.retire_timeout_s}; the launcher "
                         "retires them")

    def _entered(self, release: Release, state: ReleaseState) -> float:
        """When `release` last entered `state` (its history survives a controller crash)."""
        times = [at for name, at in release.history if name == state.value]
        return times[-1] if times else release.updated_at


def _has_flipped(release: Release) -> bool:
    """Whether the release reached its flip (the live pointer may be its own doing)."""
    return any(state == S.FLIPPING.value for state, _ in release.history)


__all__ = ["WARM_ATTEMPTS", "ReleaseSteps"]
