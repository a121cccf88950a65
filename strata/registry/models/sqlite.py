"""The SQLite ModelRegistry: one file, many processes on one machine (`strata up`).

Six tables, one JSON document per row plus the columns the writes test. It may share the
instance registry's file (whose table is `instances`), so a cluster keeps one registry.db.

    model_versions  (name, version) -> created_at, record        INSERT only: immutable
    model_routing   name -> revision, record                     compare-and-set
    deployments     key (name@version) -> revision, record       compare-and-set; deleted
    releases        release_id -> name, revision, created_at, is_terminal, record
    version_health  (key name@version, gateway) -> published_at, record     upserted; aged out
    leases          name -> revision, record                     compare-and-set

A compare-and-set is one statement: `UPDATE ... WHERE key = ? AND revision = ?`, or for
revision 0 an INSERT that does nothing on an existing row. "One release in progress per
model" is a partial unique index on releases(name) WHERE is_terminal = 0, so SQLite itself
refuses a second one, whichever process writes it. Each write runs in one IMMEDIATE
transaction together with the reads that explain a refusal, so a ConflictError names what was
really there.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from strata.clock import Clock
from strata.errors import ConflictError, RegistryError
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
from strata.state.sqlite_db import SqliteDatabase, sqlite_path

T = TypeVar("T")
Conn = sqlite3.Connection

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS model_versions (name TEXT NOT NULL, version TEXT NOT NULL, "
    "created_at REAL NOT NULL, record TEXT NOT NULL, PRIMARY KEY (name, version))",
    "CREATE TABLE IF NOT EXISTS model_routing (name TEXT PRIMARY KEY, "
    "revision INTEGER NOT NULL, record TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS deployments (key TEXT PRIMARY KEY, "
    "revision INTEGER NOT NULL, record TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS releases (release_id TEXT PRIMARY KEY, name TEXT NOT NULL, "
    "revision INTEGER NOT NULL, created_at REAL NOT NULL, is_terminal INTEGER NOT NULL, "
    "record TEXT NOT NULL)",
    "CREATE UNIQUE INDEX IF NOT EXISTS releases_one_in_progress ON releases (name) "
    "WHERE is_terminal = 0",
    "CREATE TABLE IF NOT EXISTS version_health (key TEXT NOT NULL, gateway TEXT NOT NULL, "
    "published_at REAL NOT NULL, record TEXT NOT NULL, PRIMARY KEY (key, gateway))",
    "CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, revision INTEGER NOT NULL, "
    "record TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS routing_views (gateway TEXT PRIMARY KEY, "
    "published_at REAL NOT NULL, record TEXT NOT NULL)",
)
_PRUNE_RELEASES = (
    "DELETE FROM releases WHERE name = ?1 AND is_terminal = 1 AND release_id NOT IN "
    "(SELECT release_id FROM releases WHERE name = ?1 AND is_terminal = 1 "
    "ORDER BY created_at DESC, release_id DESC LIMIT ?2)"
)


class SqliteModelRegistry:
    """A ModelRegistry in a SQLite file shared by every process that opens the same path."""

    def __init__(self, path: str | Path, *, clock: Clock = time.time,
                 busy_timeout_ms: int = 10_000) -> None:
        self.path = Path(path)
        self.clock = clock
        self._db = SqliteDatabase(self.path, schema=_SCHEMA, error=RegistryError,
                                  what="sqlite model registry", busy_timeout_ms=busy_timeout_ms)

    # --- versions ---------------------------------------------------------------------------

    async def add_version(self, version: ModelVersion) -> ModelVersion:
        new = stamp_version(version, self.clock())

        def work(conn: Conn) -> str | None:
            if conn.execute("INSERT INTO model_versions (name, version, created_at, record) "
                            "VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                            (new.name, new.version, new.created_at, _dump(new))).rowcount:
                return None
            return _one(conn, "SELECT record FROM model_versions WHERE name = ? AND version = ?",
                        (new.name, new.version))

        existing_text = await self._db.transaction(work)
        if existing_text is None:
            return new
        existing = ModelVersion.from_json(json.loads(existing_text))
        if not same_version(existing, version):
            raise version_conflict(existing, version)
        return existing

    async def get_version(self, name: str, version: str) -> ModelVersion | None:
        rows = await self._select("SELECT record FROM model_versions WHERE name = ? AND "
                                  "version = ?", (name, version))
        return ModelVersion.from_json(json.loads(rows[0])) if rows else None

    async def list_versions(self, name: str | None = None) -> list[ModelVersion]:
        where, params = ("WHERE name = ?", (name,)) if name is not None else ("", ())
        rows = await self._select(f"SELECT record FROM model_versions {where} "
                                  "ORDER BY name, created_at, version", params)
        return [ModelVersion.from_json(json.loads(r)) for r in rows]

    # --- routing ------------------------------------------------------------------------------

    async def get_routing(self, name: str) -> ModelRouting | None:
        rows = await self._select("SELECT record FROM model_routing WHERE name = ?", (name,))
        return ModelRouting.from_json(json.loads(rows[0])) if rows else None

    async def list_routing(self) -> list[ModelRouting]:
        rows = await self._select("SELECT record FROM model_routing ORDER BY name", ())
        return [ModelRouting.from_json(json.loads(r)) for r in rows]

    async def set_routing(self, routing: ModelRouting, *,
                          expected_revision: int) -> ModelRouting:
        new = next_revision(routing, expected_revision, self.clock())
        await self._cas("model_routing", "name", "routing", new.name, expected_revision, new)
        return new

    # --- deployments --------------------------------------------------------------------------

    async def put_deployment(self, deployment: Deployment, *,
                             expected_revision: int) -> Deployment:
        new = next_revision(deployment, expected_revision, self.clock())
        await self._cas("deployments", "key", "deployment", new.key, expected_revision, new)
        return new

    async def delete_deployment(self, name: str, version: str, *,
                                expected_revision: int | None = None) -> bool:
        key = f"{name}@{version}"
        sql = "DELETE FROM deployments WHERE key = ?1 AND (?2 IS NULL OR revision = ?2)"
        return bool(await self._db.call(
            lambda c: c.execute(sql, (key, expected_revision)).rowcount))

    async def list_deployments(self) -> list[Deployment]:
        rows = await self._select("SELECT record FROM deployments ORDER BY key", ())
        return [Deployment.from_json(json.loads(r)) for r in rows]

    # --- releases -----------------------------------------------------------------------------

    async def put_release(self, release: Release, *, expected_revision: int) -> Release:
        new = next_revision(release, expected_revision, self.clock())
        columns = (new.name, new.revision, new.created_at, int(new.is_terminal), _dump(new))

        def write(conn: Conn) -> None:
            if expected_revision == 0:
                cursor = conn.execute("INSERT INTO releases (name, revision, created_at, "
                                      "is_terminal, record, release_id) VALUES (?, ?, ?, ?, ?, ?) "
                                      "ON CONFLICT DO NOTHING", (*columns, new.release_id))
            else:
                cursor = conn.execute("UPDATE OR IGNORE releases SET name = ?, revision = ?, "
                                      "created_at = ?, is_terminal = ?, record = ? "
                                      "WHERE release_id = ? AND revision = ?",
                                      (*columns, new.release_id, expected_revision))
            if cursor.rowcount == 0:
                raise _release_refusal(conn, new, expected_revision)

        await self._db.transaction(write)
        return new

    async def get_release(self, release_id: str) -> Release | None:
        rows = await self._select("SELECT record FROM releases WHERE release_id = ?",
                                  (release_id,))
        return Release.from_json(json.loads(rows[0])) if rows else None

    async def list_releases(self, name: str | None = None) -> list[Release]:
        where, params = ("WHERE name = ?", (name,)) if name is not None else ("", ())
        rows = await self._select(f"SELECT record FROM releases {where} "
                                  "ORDER BY created_at, release_id", params)
        return [Release.from_json(json.loads(r)) for r in rows]

    async def prune_releases(self, name: str, *, keep: int) -> int:
        return int(await self._db.call(
            lambda c: c.execute(_PRUNE_RELEASES, (name, max(0, keep))).rowcount))

    # --- health windows -------------------------------------------------------------------------

    async def put_health(self, window: HealthWindow) -> HealthWindow:
        stored = replace(window, published_at=self.clock())

        def write(conn: Conn) -> None:
            conn.execute("DELETE FROM version_health WHERE published_at < ?",
                         (stored.published_at - HEALTH_RETENTION_S,))
            conn.execute("INSERT OR REPLACE INTO version_health (key, gateway, published_at, "
                         "record) VALUES (?, ?, ?, ?)",
                         (stored.key, stored.gateway, stored.published_at, _dump(stored)))

        await self._db.transaction(write)
        return stored

    async def list_health(self, name: str, version: str) -> list[HealthWindow]:
        rows = await self._select("SELECT record FROM version_health WHERE key = ? AND "
                                  "published_at >= ? ORDER BY gateway",
                                  (f"{name}@{version}", self.clock() - HEALTH_RETENTION_S))
        return [HealthWindow.from_json(json.loads(r)) for r in rows]

    # --- leases (strata/registry/leases.py) ----------------------------------------------------

    async def get_lease(self, name: str) -> Lease | None:
        rows = await self._select("SELECT record FROM leases WHERE name = ?", (name,))
        return Lease.from_json(json.loads(rows[0])) if rows else None

    async def put_lease(self, lease: Lease, *, expected_revision: int) -> Lease:
        new = next_revision(lease, expected_revision, self.clock())
        await self._cas("leases", "name", "lease", new.name, expected_revision, new)
        return new

    async def close(self) -> None:
        await self._db.aclose()

    # --- internals ----------------------------------------------------------------------------

    async def _cas(self, table: str, key_column: str, kind: str, key: str,
                   expected_revision: int, new: ModelRouting | Deployment | Lease) -> None:
        """Write `new` under `key` if the stored revision is `expected_revision` (0: absent)."""
        if expected_revision == 0:
            sql = (f"INSERT INTO {table} (revision, record, {key_column}) VALUES (?, ?, ?) "
                   "ON CONFLICT DO NOTHING")
            params: tuple[Any, ...] = (new.revision, _dump(new), key)
        else:
            sql = f"UPDATE {table} SET revision = ?, record = ? WHERE {key_column} = ? " \
                  "AND revision = ?"
            params = (new.revision, _dump(new), key, expected_revision)

        def write(conn: Conn) -> None:
            if conn.execute(sql, params).rowcount == 0:
                stored = _one(conn, f"SELECT revision FROM {table} WHERE {key_column} = ?",
                              (key,))
                raise stale(kind, key, expected_revision, stored or 0)

        await self._db.transaction(write)

    async def _select(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        """The first column of every row."""
        return await self._db.call(lambda c: [r[0] for r in c.execute(sql, params)])

    # --- routing views (strata/registry/models/views.py) ---------------------------------------
    # (the schema is applied, idempotently, whenever a file opens: an older file gains the table)

    async def put_view(self, view: RoutingView) -> RoutingView:
        stored = replace(view, published_at=self.clock())

        def write(conn: Conn) -> None:
            conn.execute("DELETE FROM routing_views WHERE published_at < ?",
                         (stored.published_at - VIEW_RETENTION_S,))
            conn.execute("INSERT OR REPLACE INTO routing_views (gateway, published_at, record) "
                         "VALUES (?, ?, ?)", (stored.gateway, stored.published_at, _dump(stored)))

        await self._db.transaction(write)
        return stored

    async def list_views(self) -> list[RoutingView]:
        since = self.clock() - VIEW_RETENTION_S

        def read(conn: Conn) -> list[str]:
            return [r[0] for r in conn.execute("SELECT record FROM routing_views WHERE "
                                               "published_at >= ? ORDER BY gateway", (since,))]

        return [RoutingView.from_json(json.loads(t)) for t in await self._db.call(read)]


def _release_refusal(conn: Conn, new: Release, expected_revision: int) -> ConflictError:
    stored = _one(conn, "SELECT revision FROM releases WHERE release_id = ?", (new.release_id,))
    if (stored or 0) != expected_revision:
        return stale("release", new.release_id, expected_revision, stored or 0)
    other = conn.execute("SELECT release_id, record FROM releases WHERE name = ? AND "
                         "is_terminal = 0", (new.name,)).fetchone()
    if other is None:  # unreachable while the index holds: the write can only lose to these two
        return ConflictError(f"release {new.release_id!r} was refused; read it and retry")
    return release_in_progress(new.name, other[0], json.loads(other[1])["state"])


def _one(conn: Conn, sql: str, params: tuple[Any, ...]) -> Any:
    row = conn.execute(sql, params).fetchone()
    return None if row is None else row[0]


def _dump(record: ModelVersion | ModelRouting | Deployment | Release | HealthWindow | Lease
          | RoutingView) -> str:
    return json.dumps(record.to_json())



def from_url(url: str, options: ModelRegistryOptions) -> SqliteModelRegistry:
    path = sqlite_path(url, what="model registry",
                       example="sqlite:///var/run/strata/registry.db")
    return SqliteModelRegistry(path, clock=options.clock)


__all__ = ["SqliteModelRegistry", "from_url"]
