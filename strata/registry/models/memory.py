"""The in-process ModelRegistry: dicts, for tests and single-process setups.

Records are kept as JSON text, exactly what the SQLite and Redis backends store, so a record
that does not round-trip fails here first, and no caller can mutate a stored record (a
Release's `stats` dict) through a reference it was handed. No method awaits between its read
and its write, so each is atomic on the event loop without a lock.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from strata.clock import Clock
from strata.registry.leases import Lease
from strata.registry.models.base import (
    Deployment,
    ModelRegistryOptions,
    ModelRouting,
    ModelVersion,
    Release,
)
from strata.registry.models.cas import (
    next_revision,
    release_in_progress,
    same_version,
    stale,
    stamp_version,
    version_conflict,
)
from strata.registry.models.views import VIEW_RETENTION_S, RoutingView
from strata.registry.releases.health import HEALTH_RETENTION_S, HealthWindow


class MemoryModelRegistry:
    """A ModelRegistry held in this process's memory; nothing is shared with other processes."""

    def __init__(self, *, clock: Clock = time.time) -> None:
        self.clock = clock
        self._versions: dict[str, str] = {}  # name@version -> JSON
        self._routing: dict[str, str] = {}  # name -> JSON
        self._deployments: dict[str, str] = {}  # name@version -> JSON
        self._releases: dict[str, str] = {}  # release_id -> JSON
        self._health: dict[tuple[str, str], str] = {}  # (name@version, gateway) -> JSON
        self._leases: dict[str, str] = {}  # name -> JSON
        self._views: dict[str, str] = {}  # gateway -> JSON (registry/models/views.py)

    # --- versions ---------------------------------------------------------------------------

    async def add_version(self, version: ModelVersion) -> ModelVersion:
        stored = self._versions.get(version.key)
        if stored is not None:
            existing = ModelVersion.from_json(json.loads(stored))
            if not same_version(existing, version):
                raise version_conflict(existing, version)
            return existing
        new = stamp_version(version, self.clock())
        self._versions[version.key] = _dump(new)
        return new

    async def get_version(self, name: str, version: str) -> ModelVersion | None:
        stored = self._versions.get(f"{name}@{version}")
        return None if stored is None else ModelVersion.from_json(json.loads(stored))

    async def list_versions(self, name: str | None = None) -> list[ModelVersion]:
        versions = [ModelVersion.from_json(json.loads(v)) for v in self._versions.values()]
        return sorted((v for v in versions if name is None or v.name == name),
                      key=lambda v: (v.name, v.created_at, v.version))

    # --- routing ------------------------------------------------------------------------------

    async def get_routing(self, name: str) -> ModelRouting | None:
        stored = self._routing.get(name)
        return None if stored is None else ModelRouting.from_json(json.loads(stored))

    async def list_routing(self) -> list[ModelRouting]:
        return [ModelRouting.from_json(json.loads(self._routing[k])) for k in sorted(self._routing)]

    async def set_routing(self, routing: ModelRouting, *,
                          expected_revision: int) -> ModelRouting:
        new = next_revision(routing, expected_revision, self.clock())
        self._check("routing", self._routing, routing.name, expected_revision)
        self._routing[routing.name] = _dump(new)
        return new

    # --- deployments --------------------------------------------------------------------------

    async def put_deployment(self, deployment: Deployment, *,
                             expected_revision: int) -> Deployment:
        new = next_revision(deployment, expected_revision, self.clock())
        self._check("deployment", self._deployments, deployment.key, expected_revision)
        self._deployments[deployment.key] = _dump(new)
        return new

    async def delete_deployment(self, name: str, version: str, *,
                                expected_revision: int | None = None) -> bool:
        key = f"{name}@{version}"
        stored = self._deployments.get(key)
        if stored is None or (expected_revision is not None
                              and json.loads(stored)["revision"] != expected_revision):
            return False
        del self._deployments[key]
        return True

    async def list_deployments(self) -> list[Deployment]:
        return [Deployment.from_json(json.loads(self._deployments[k]))
                for k in sorted(self._deployments)]

    # --- releases -----------------------------------------------------------------------------

    async def put_release(self, release: Release, *, expected_revision: int) -> Release:
        new = next_revision(release, expected_revision, self.clock())
        self._check("release", self._releases, release.release_id, expected_revision)
        if not new.is_terminal:
            for other in self._releases_of(release.name):
                if other.release_id != release.release_id and not other.is_terminal:
                    raise release_in_progress(release.name, other.release_id, other.state)
        self._releases[release.release_id] = _dump(new)
        return new

    async def get_release(self, release_id: str) -> Release | None:
        stored = self._releases.get(release_id)
        return None if stored is None else Release.from_json(json.loads(stored))

    async def list_releases(self, name: str | None = None) -> list[Release]:
        return self._releases_of(name)

    async def prune_releases(self, name: str, *, keep: int) -> int:
        finished = [r for r in self._releases_of(name) if r.is_terminal]
        doomed = finished[:max(0, len(finished) - keep)]
        for release in doomed:
            del self._releases[release.release_id]
        return len(doomed)

    # --- health windows -------------------------------------------------------------------------

    async def put_health(self, window: HealthWindow) -> HealthWindow:
        now = self.clock()
        stored = replace(window, published_at=now)
        for key, text in list(self._health.items()):
            if json.loads(text)["published_at"] < now - HEALTH_RETENTION_S:
                del self._health[key]
        self._health[(stored.key, stored.gateway)] = _dump(stored)
        return stored

    async def list_health(self, name: str, version: str) -> list[HealthWindow]:
        key, since = f"{name}@{version}", self.clock() - HEALTH_RETENTION_S
        windows = [HealthWindow.from_json(json.loads(text))
                   for (k, _), text in sorted(self._health.items()) if k == key]
        return [w for w in windows if w.published_at >= since]

    # --- leases (strata/registry/leases.py) ----------------------------------------------------

    async def get_lease(self, name: str) -> Lease | None:
        stored = self._leases.get(name)
        return None if stored is None else Lease.from_json(json.loads(stored))

    async def put_lease(self, lease: Lease, *, expected_revision: int) -> Lease:
        new = next_revision(lease, expected_revision, self.clock())
        self._check("lease", self._leases, lease.name, expected_revision)
        self._leases[lease.name] = _dump(new)
        return new

    async def close(self) -> None:
        return None

    # --- internals ----------------------------------------------------------------------------

    def _releases_of(self, name: str | None) -> list[Release]:
        releases = [Release.from_json(json.loads(r)) for r in self._releases.values()]
        return sorted((r for r in releases if name is None or r.name == name),
                      key=lambda r: (r.created_at, r.release_id))

    @staticmethod
    def _check(kind: str, table: dict[str, str], key: str, expected_revision: int) -> None:
        stored = table.get(key)
        revision = 0 if stored is None else int(json.loads(stored)["revision"])
        if revision != expected_revision:
            raise stale(kind, key, expected_revision, revision)

    # --- routing views (strata/registry/models/views.py) ---------------------------------------

    async def put_view(self, view: RoutingView) -> RoutingView:
        stored = replace(view, published_at=self.clock())
        self._views[stored.gateway] = _dump(stored)
        return stored

    async def list_views(self) -> list[RoutingView]:
        since = self.clock() - VIEW_RETENTION_S
        for gateway, text in list(self._views.items()):
            if json.loads(text)["published_at"] < since:
                del self._views[gateway]
        return [RoutingView.from_json(json.loads(self._views[g])) for g in sorted(self._views)]


def _dump(record: Any) -> str:
    return json.dumps(record.to_json())



def from_url(url: str, options: ModelRegistryOptions) -> MemoryModelRegistry:
    return MemoryModelRegistry(clock=options.clock)


__all__ = ["MemoryModelRegistry", "from_url"]
