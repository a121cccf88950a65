"""The Redis ModelRegistry: many machines. Every record is one key; index sets list them.

    {prefix}:version:{name}@{version}   STRING  JSON record (immutable: SET only when absent)
    {prefix}:routing:{name}             HASH    revision, record (JSON)
    {prefix}:deployment:{name}@{ver}    HASH    revision, record (JSON)
    {prefix}:release:{release_id}       HASH    revision, record (JSON)
    {prefix}:lease:{name}               HASH    revision, record (JSON)
    {prefix}:in_progress:{name}         STRING  the release_id of the model's non-terminal release
    {prefix}:versions, :routings, :deployments, :releases     SETs of the keys' last parts
    {prefix}:releases:{name}            SET     release ids of one model
    {prefix}:health:{name}@{version}    HASH    gateway -> its health window (JSON)
    {prefix}:health_at:{name}@{version} ZSET    gateway by published_at (to age windows out)

Every write is one Lua script, so it is atomic on the server: a compare-and-set reads the stored
revision and writes only when it is the expected one. The release script also keeps
`in_progress:{name}` (set while a release is not terminal, cleared once terminal), so "one
release in progress per model" is checked and taken at once. Listing reads index sets, never KEYS.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from strata.clock import Clock
from strata.errors import RegistryError
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
from strata.state.redis_db import RedisDatabase

# KEYS: record, index.  ARGV: json, index member.  -> nil when added, else the stored JSON
_ADD_VERSION = """
local stored = redis.call('GET', KEYS[1])
if stored then return stored end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
return false
"""
# KEYS: record, index.  ARGV: expected revision, json, index member.
# -> -1 when written, else the stored revision (0: absent)
_CAS = """
local stored = tonumber(redis.call('HGET', KEYS[1], 'revision') or '0')
if stored ~= tonumber(ARGV[1]) then return stored end
redis.call('HSET', KEYS[1], 'revision', stored + 1, 'record', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
return -1
"""
# KEYS: record, releases, releases of the model, in_progress of the model.
# ARGV: expected revision, json, release_id, '1' if the new state is terminal else '0'.
# -> {'ok'} | {'stale', stored revision} | {'busy', release_id in progress}
_PUT_RELEASE = """
local stored = tonumber(redis.call('HGET', KEYS[1], 'revision') or '0')
if stored ~= tonumber(ARGV[1]) then return {'stale', stored} end
local active = redis.call('GET', KEYS[4])
if ARGV[4] == '0' then
    if active and active ~= ARGV[3] then return {'busy', active} end
    redis.call('SET', KEYS[4], ARGV[3])
elseif active == ARGV[3] then
    redis.call('DEL', KEYS[4])
end
redis.call('HSET', KEYS[1], 'revision', stored + 1, 'record', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[3])
return {'ok'}
"""

# KEYS: record, index.  ARGV: expected revision ('' = any), index member.  -> 1 when deleted
_DELETE_IF = """
local stored = redis.call('HGET', KEYS[1], 'revision')
if not stored then return 0 end
if ARGV[1] ~= '' and tonumber(stored) ~= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
return 1
"""

# KEYS: release, releases, releases of the model, in_progress of the model.  ARGV: release_id.
# -> 1 when deleted (never the release in progress)
_DELETE_RELEASE = """
if redis.call('GET', KEYS[4]) == ARGV[1] then return 0 end
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
return redis.call('DEL', KEYS[1])
"""
# KEYS: health, health_at.  ARGV: gateway, json, published_at, drop before, retention seconds.
_PUT_HEALTH = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
for _, gateway in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[4])) do
    redis.call('HDEL', KEYS[1], gateway)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return 0
"""


class RedisModelRegistry:
    """A ModelRegistry in a Redis server shared by every process using the same URL and prefix."""

    def __init__(self, url: str, *, clock: Clock = time.time,
                 prefix: str = "strata:models") -> None:
        self.url = url
        self.clock = clock
        self.prefix = prefix
        self._db = RedisDatabase(url, error=RegistryError, what="redis model registry",
                                 decode_responses=True)
        self._client: Any = self._db.client
        self._add_version: Any = self._db.script(_ADD_VERSION)
        self._cas: Any = self._db.script(_CAS)
        self._put_release: Any = self._db.script(_PUT_RELEASE)
        self._delete_if: Any = self._db.script(_DELETE_IF)
        self._delete_release: Any = self._db.script(_DELETE_RELEASE)
        self._put_health: Any = self._db.script(_PUT_HEALTH)

    # --- versions ---------------------------------------------------------------------------

    async def add_version(self, version: ModelVersion) -> ModelVersion:
        new = stamp_version(version, self.clock())
        keys = [self._key("version", new.key), self._key("versions")]
        args = [_dump(new), new.key]
        stored = await self._db.call(lambda: self._add_version(keys=keys, args=args))
        if stored is None:
            return new
        existing = ModelVersion.from_json(json.loads(stored))
        if not same_version(existing, version):
            raise version_conflict(existing, version)
        return existing

    async def get_version(self, name: str, version: str) -> ModelVersion | None:
        key = self._key("version", f"{name}@{version}")
        text = await self._db.call(lambda: self._client.get(key))
        return None if text is None else ModelVersion.from_json(json.loads(text))

    async def list_versions(self, name: str | None = None) -> list[ModelVersion]:
        members = await self._db.call(lambda: self._client.smembers(self._key("versions")))
        if name is not None:
            members = {m for m in members if m.partition("@")[0] == name}
        texts = await self._get_all([self._key("version", m) for m in members])
        versions = [ModelVersion.from_json(json.loads(t)) for t in texts if t is not None]
        return sorted(versions, key=lambda v: (v.name, v.created_at, v.version))

    # --- routing ------------------------------------------------------------------------------

    async def get_routing(self, name: str) -> ModelRouting | None:
        text = await self._record(self._key("routing", name))
        return None if text is None else ModelRouting.from_json(json.loads(text))

    async def list_routing(self) -> list[ModelRouting]:
        routings = [ModelRouting.from_json(json.loads(t))
                    for t in await self._records("routings", "routing")]
        return sorted(routings, key=lambda r: r.name)

    async def set_routing(self, routing: ModelRouting, *,
                          expected_revision: int) -> ModelRouting:
        new = next_revision(routing, expected_revision, self.clock())
        await self._compare_and_set("routing", new.name, expected_revision, new)
        return new

    # --- deployments --------------------------------------------------------------------------

    async def put_deployment(self, deployment: Deployment, *,
                             expected_revision: int) -> Deployment:
        new = next_revision(deployment, expected_revision, self.clock())
        await self._compare_and_set("deployment", new.key, expected_revision, new)
        return new

    async def delete_deployment(self, name: str, version: str, *,
                                expected_revision: int | None = None) -> bool:
        key = f"{name}@{version}"
        keys = [self._key("deployment", key), self._key("deployments")]
        expected = "" if expected_revision is None else str(expected_revision)
        return bool(await self._db.call(lambda: self._delete_if(keys=keys, args=[expected, key])))

    async def list_deployments(self) -> list[Deployment]:
        deployments = [Deployment.from_json(json.loads(t))
                       for t in await self._records("deployments", "deployment")]
        return sorted(deployments, key=lambda d: d.key)

    # --- releases -----------------------------------------------------------------------------

    async def put_release(self, release: Release, *, expected_revision: int) -> Release:
        new = next_revision(release, expected_revision, self.clock())
        keys = [self._key("release", new.release_id), self._key("releases"),
                self._key("releases", new.name), self._key("in_progress", new.name)]
        args = [expected_revision, _dump(new), new.release_id, int(new.is_terminal)]
        outcome = await self._db.call(lambda: self._put_release(keys=keys, args=args))
        if outcome[0] == "stale":
            raise stale("release", new.release_id, expected_revision, int(outcome[1]))
        if outcome[0] == "busy":
            other = await self.get_release(outcome[1])
            raise release_in_progress(new.name, outcome[1], other.state if other else "?")
        return new

    async def get_release(self, release_id: str) -> Release | None:
        text = await self._record(self._key("release", release_id))
        return None if text is None else Release.from_json(json.loads(text))

    async def list_releases(self, name: str | None = None) -> list[Release]:
        index = "releases" if name is None else f"releases:{name}"
        releases = [Release.from_json(json.loads(t))
                    for t in await self._records(index, "release")]
        return sorted(releases, key=lambda r: (r.created_at, r.release_id))

    async def prune_releases(self, name: str, *, keep: int) -> int:
        finished = [r.release_id for r in await self.list_releases(name) if r.is_terminal]
        return sum([await self._delete_finished(name, release_id)
                    for release_id in finished[:max(0, len(finished) - keep)]])

    # --- health windows -------------------------------------------------------------------------

    async def put_health(self, window: HealthWindow) -> HealthWindow:
        stored = replace(window, published_at=self.clock())
        keys = [self._key("health", stored.key), self._key("health_at", stored.key)]
        args = [stored.gateway, _dump(stored), repr(stored.published_at),
                repr(stored.published_at - HEALTH_RETENTION_S), int(HEALTH_RETENTION_S)]
        await self._db.call(lambda: self._put_health(keys=keys, args=args))
        return stored

    async def list_health(self, name: str, version: str) -> list[HealthWindow]:
        key = self._key("health", f"{name}@{version}")
        texts: dict[str, str] = await self._db.call(lambda: self._client.hgetall(key))
        windows = [HealthWindow.from_json(json.loads(texts[g])) for g in sorted(texts)]
        return [w for w in windows if w.published_at >= self.clock() - HEALTH_RETENTION_S]

    # --- leases (strata/registry/leases.py) ----------------------------------------------------

    async def get_lease(self, name: str) -> Lease | None:
        text = await self._record(self._key("lease", name))
        return None if text is None else Lease.from_json(json.loads(text))

    async def put_lease(self, lease: Lease, *, expected_revision: int) -> Lease:
        new = next_revision(lease, expected_revision, self.clock())
        await self._compare_and_set("lease", new.name, expected_revision, new)
        return new

    async def close(self) -> None:
        await self._db.aclose()

    # --- internals ----------------------------------------------------------------------------

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def _compare_and_set(self, kind: str, key: str, expected_revision: int,
                               new: ModelRouting | Deployment | Lease) -> None:
        keys = [self._key(kind, key), self._key(f"{kind}s")]
        args = [expected_revision, _dump(new), key]
        stored = await self._db.call(lambda: self._cas(keys=keys, args=args))
        if int(stored) != -1:
            raise stale(kind, key, expected_revision, int(stored))

    async def _delete_finished(self, name: str, release_id: str) -> int:
        keys = [self._key("release", release_id), self._key("releases"),
                self._key("releases", name), self._key("in_progress", name)]
        return int(await self._db.call(lambda: self._delete_release(keys=keys,
                                                                    args=[release_id])))

    async def _record(self, key: str) -> str | None:
        text: str | None = await self._db.call(lambda: self._client.hget(key, "record"))
        return text

    async def _records(self, index: str, kind: str) -> list[str]:
        """The JSON of every record whose id is in the set `index` (skipping any deleted
        between the two reads)."""
        members = await self._db.call(lambda: self._client.smembers(self._key(index)))

        async def read() -> list[str | None]:
            async with self._client.pipeline(transaction=False) as pipe:
                for member in members:
                    pipe.hget(self._key(kind, member), "record")
                result: list[str | None] = await pipe.execute()
                return result

        return [t for t in await self._db.call(read) if t is not None]

    async def _get_all(self, keys: list[str]) -> list[str | None]:
        if not keys:
            return []
        texts: list[str | None] = await self._db.call(lambda: self._client.mget(keys))
        return texts

    # --- routing views (strata/registry/models/views.py) ---------------------------------------
    # {prefix}:views  HASH  gateway -> its view (JSON); views past VIEW_RETENTION_S are dropped
    # when listed

    async def put_view(self, view: RoutingView) -> RoutingView:
        stored = replace(view, published_at=self.clock())
        key, text = self._key("views"), _dump(stored)
        await self._db.call(lambda: self._client.hset(key, stored.gateway, text))
        return stored

    async def list_views(self) -> list[RoutingView]:
        key = self._key("views")
        texts: dict[str, str] = await self._db.call(lambda: self._client.hgetall(key))
        views = [RoutingView.from_json(json.loads(texts[g])) for g in sorted(texts)]
        since = self.clock() - VIEW_RETENTION_S
        gone = [v.gateway for v in views if v.published_at < since]
        if gone:
            await self._db.call(lambda: self._client.hdel(key, *gone))
        return [v for v in views if v.published_at >= since]


def _dump(record: ModelVersion | ModelRouting | Deployment | Release | HealthWindow | Lease
          | RoutingView) -> str:
    return json.dumps(record.to_json())



def from_url(url: str, options: ModelRegistryOptions) -> RedisModelRegistry:
    return RedisModelRegistry(url, clock=options.clock)


__all__ = ["RedisModelRegistry", "from_url"]
