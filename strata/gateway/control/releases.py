"""Releases driven from a gateway: the controller's tasks, resumption, warming and health.

Every gateway with a model registry runs a `ReleaseService`. A release asked for through the
admin API (`POST /admin/releases`) is driven by the gateway that received it; every
`resume_interval_s` each gateway also looks for releases whose controller stopped renewing its
lease (its gateway crashed or restarted) and drives them to the end. The release's state lives in
the registry, so whichever gateway resumes it continues from the stored step.

A canary is judged on every gateway's traffic, not only the driver's: while a model has a
canary, each gateway publishes its window of the canary and of the live version to the registry
(`HealthPublisher`, every `publish_interval_s`), and the driver adds the windows other gateways
published recently to its own (`PooledHealth`, registry/version_health.py).

The gateway never starts processes: a release writes Deployments, and the launcher in use
(`strata up`'s supervisor, or its Ray launcher) starts and retires instances to match. A LoRA
adapter's release starts nothing either: it loads the new adapter version into the base's
running instances through their admin routes (control/adapters.py), and every
`resume_interval_s` each gateway also loads the adapter versions that take traffic on instances
that lack them (`AdapterSync`: an instance started after the release).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time

import httpx

from strata.clock import Clock
from strata.errors import ConflictError
from strata.gateway.control.adapters import InstanceAdapters
from strata.gateway.path.versions import VersionRouter, VersionStats
from strata.registry.instances.base import Registry
from strata.registry.instances.records import InstanceRecord
from strata.registry.models import ModelRegistry, Release, Strategy
from strata.registry.releases.adapter_sync import AdapterSync
from strata.registry.releases.controller import ReleaseConfig, ReleaseController, VersionHealth
from strata.registry.releases.health import HealthBoard, pooled

logger = logging.getLogger("strata.gateway.control.releases")
WARM_PROMPT = "Hello"


def controller_owner(port: int) -> str:
    """A name unique to this gateway process (the lease holder's name in release records)."""
    return f"gateway-{socket.gethostname()}-{os.getpid()}-{port}-{secrets.token_hex(2)}"


class InstanceWarmer:
    """Sends one real request to a new instance, straight to it (not through any gateway)."""

    def __init__(self, client: httpx.AsyncClient, *, timeout_s: float,
                 api_key: str | None = None) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def __call__(self, record: InstanceRecord) -> None:
        body = {"model": f"{record.model}@{record.version}", "prompt": WARM_PROMPT,
                "max_tokens": 1, "temperature": 0}
        response = await self.client.post(f"{record.url}/v1/completions", json=body,
                                          headers=self.headers, timeout=self.timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"the warm-up request to {record.instance_id} answered "
                               f"{response.status_code}: {response.text[:200]}")


class PooledHealth:
    """A version's health over every gateway: this gateway's own window, read now, plus the
    windows the others published in the last `max_age_s` (older ones are of gateways that
    stopped or lost the registry)."""

    def __init__(self, board: HealthBoard, stats: VersionStats, *, gateway: str,
                 max_age_s: float, clock: Clock = time.time) -> None:
        self.board, self.stats, self.gateway = board, stats, gateway
        self.max_age_s, self.clock = max_age_s, clock

    async def __call__(self, name: str, version: str) -> VersionHealth:
        since = self.clock() - self.max_age_s
        others = [w for w in await self.board.list_health(name, version)
                  if w.gateway != self.gateway and w.published_at >= since]
        return pooled([self.stats.window(self.gateway, name, version), *others])


class HealthPublisher:
    """Publishes this gateway's windows of every model that has a canary: the canary's and the
    live version's (what the canary is compared with)."""

    def __init__(self, board: HealthBoard, stats: VersionStats, router: VersionRouter, *,
                 gateway: str) -> None:
        self.board, self.stats, self.router, self.gateway = board, stats, router, gateway

    async def publish_once(self) -> None:
        for routing in list(self.router.routing.values()):
            if routing.canary is None:
                continue
            for version in (v for v in (routing.canary, routing.live) if v is not None):
                window = self.stats.window(self.gateway, routing.name, version)
                if window.num_requests:
                    await self.board.put_health(window)


class ReleaseService:
    """Owns this gateway's release controller, the tasks that drive releases and the publisher
    of this gateway's canary health."""

    def __init__(self, controller: ReleaseController, *, resume_interval_s: float = 1.0,
                 publisher: HealthPublisher | None = None,
                 publish_interval_s: float = 1.0, adapters: AdapterSync | None = None) -> None:
        self.controller = controller
        self.resume_interval_s = resume_interval_s
        self.publisher = publisher
        self.publish_interval_s = publish_interval_s
        self.adapters = adapters
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def publish_health(self) -> None:
        if self.publisher is not None:
            await self.publisher.publish_once()

    async def sync_adapters(self) -> None:
        if self.adapters is not None:
            await self.adapters.sync_once()

    async def start(self, name: str, version: str, *, strategy: Strategy,
                    canary_weight: float, replicas: int | None) -> Release:
        release = await self.controller.start(name, version, strategy=strategy,
                                              canary_weight=canary_weight, replicas=replicas)
        self._spawn(release.release_id)
        return release

    async def rollback(self, name: str) -> Release:
        release = await self.controller.request_rollback(name)
        if release.owner == self.controller.owner:
            self._spawn(release.release_id)
        return release

    async def resume_once(self) -> None:
        for release in await self.controller.resumable():
            logger.info("resuming release %s (%s) left by %s", release.release_id,
                        release.state, release.owner or "nobody")
            self._spawn(release.release_id)

    def _spawn(self, release_id: str) -> None:
        task = self._tasks.get(release_id)
        if task is None or task.done():
            self._tasks[release_id] = asyncio.create_task(self._drive(release_id))

    async def _drive(self, release_id: str) -> None:
        try:
            final = await self.controller.drive(release_id)
            logger.info("release %s: %s %s", release_id, final.state, final.reason)
        except ConflictError as exc:  # another gateway holds it
            logger.info("release %s is driven elsewhere: %s", release_id, exc)
        except Exception:
            logger.exception("release %s: the controller failed; another gateway (or this "
                             "one) resumes it once its lease expires", release_id)

    async def close(self) -> None:
        """Stop driving: the leases expire and another gateway (or a restart) resumes."""
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


def build_release_service(models: ModelRegistry, instances: Registry, stats: VersionStats,
                          router: VersionRouter, control: httpx.AsyncClient, *, owner: str,
                          warm_timeout_s: float, api_key: str | None,
                          publish_interval_s: float = 1.0,
                          config: ReleaseConfig | None = None,
                          fleet_key: str | None = None) -> ReleaseService:
    """The service of one gateway; `owner` names it in release leases and health windows.
    Windows older than five publish intervals (at least 5 s) do not count. `fleet_key` opens
    the instances' adapter routes (the internal key, else an admin key)."""
    health = PooledHealth(models, stats, gateway=owner,
                          max_age_s=max(5 * publish_interval_s, 5.0))
    warm = InstanceWarmer(control, timeout_s=warm_timeout_s, api_key=api_key)
    fleet = InstanceAdapters(control, timeout_s=warm_timeout_s, key=fleet_key)
    controller = ReleaseController(models, instances, owner=owner, warm=warm, health=health,
                                   config=config, adapters=fleet)
    publisher = HealthPublisher(models, stats, router, gateway=owner)
    return ReleaseService(controller, publisher=publisher,
                          publish_interval_s=publish_interval_s,
                          adapters=AdapterSync(models, instances, fleet))


__all__ = ["HealthPublisher", "InstanceWarmer", "PooledHealth", "ReleaseService",
           "build_release_service", "controller_owner"]
