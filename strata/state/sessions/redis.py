"""The Redis session store: many machines share one history.

Two keys per session (the tenant is length-prefixed so no (tenant, id) pair can collide):

    {prefix}:meta:{len(tenant)}:{tenant}:{id}  HASH revision, model, version, created_at,
                                               updated_at, tenant, session_id
    {prefix}:msgs:{len(tenant)}:{tenant}:{id}  LIST of JSON messages, in order

An append is one Lua script (compare the revision, RPUSH the messages, bump the revision, PEXPIRE
both keys, answer the session as written), so it is atomic on the server and reports its own
turn's revision, never a later writer's; a read is one script too, so it never sees a half
written turn. TTL is Redis' own (PEXPIRE): an expired session is simply gone.

Durability is Redis': with `appendfsync="always"` the store runs `CONFIG SET appendonly yes` and
`CONFIG SET appendfsync always` before its first command, so every acknowledged append is on disk
before the reply. Where CONFIG is disabled, start the server with
`--appendonly yes --appendfsync always` instead. With `replicas=N` an append is acknowledged
only once N replicas hold it (WAIT on the append's connection), so a Sentinel failover
(`redis+sentinel://`, strata/state/redis_db.py) loses no acknowledged turn. One primary (not
Redis Cluster).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ResponseError

from strata.errors import ConfigError, SessionStoreUnavailableError
from strata.state.redis_db import RedisDatabase
from strata.state.sessions.base import (
    Clock,
    Message,
    SessionRecord,
    SessionStoreOptions,
    cas_failure,
    check_append,
)

_APPEND = """
local rev = tonumber(redis.call('HGET', KEYS[1], 'revision') or '0')
if rev ~= tonumber(ARGV[1]) then return {0, rev, {}, {}} end
if rev == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('HSET', KEYS[1], 'created_at', ARGV[2], 'tenant', ARGV[6], 'session_id', ARGV[7])
end
redis.call('HSET', KEYS[1], 'revision', rev + 1, 'updated_at', ARGV[2], 'model', ARGV[3],
           'version', ARGV[4])
for i = 8, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
local ttl_ms = tonumber(ARGV[5])
for _, key in ipairs(KEYS) do
  if ttl_ms > 0 then redis.call('PEXPIRE', key, ttl_ms) else redis.call('PERSIST', key) end
end
return {1, rev + 1, redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1)}
"""
_READ = """
local meta = redis.call('HGETALL', KEYS[1])
if #meta == 0 then return {} end
return {meta, redis.call('LRANGE', KEYS[2], 0, -1)}
"""


class RedisSessionStore:
    """A SessionStore in a Redis server shared by every instance that uses the same URL."""

    def __init__(self, url: str, *, clock: Clock = time.time, appendfsync: str | None = None,
                 replicas: int = 0, replica_timeout_s: float = 2.0,
                 prefix: str = "strata:sessions") -> None:
        self.url = url
        self.clock = clock
        self.prefix = prefix
        self.appendfsync = appendfsync
        self.replicas = replicas
        self.replica_timeout_s = replica_timeout_s
        # reconnects on its own after a restart; a few quick retries ride over a short outage
        self._db = RedisDatabase(
            url, error=SessionStoreUnavailableError, what="redis session store",
            setup=None if appendfsync is None else self._configure,
            decode_responses=True, socket_connect_timeout=2.0, socket_timeout=10.0,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3))
        self._client: Any = self._db.client
        self._append: Any = self._db.script(_APPEND)
        self._read: Any = self._db.script(_READ)

    async def get(self, session_id: str, *, tenant: str) -> SessionRecord | None:
        return await self._get_key(self._keys(tenant, session_id))

    async def append(self, session_id: str, *, tenant: str, expected_revision: int,
                     messages: Sequence[Message], model: str, version: str,
                     ttl_s: float | None) -> SessionRecord:
        check_append(session_id, tenant, expected_revision, ttl_s)
        keys = self._keys(tenant, session_id)
        ttl_ms = 0 if ttl_s is None else max(1, round(ttl_s * 1000))
        args = [expected_revision, repr(float(self.clock())), model, version, ttl_ms, tenant,
                session_id, *(json.dumps(m) for m in messages)]
        if self.replicas:
            is_done, revision, meta, stored = await self._db.replicated(
                self._append, keys=list(keys), args=args, num_replicas=self.replicas,
                timeout_s=self.replica_timeout_s)
        else:
            is_done, revision, meta, stored = await self._db.call(
                lambda: self._append(keys=keys, args=args))
        if not is_done:
            raise cas_failure(session_id, expected_revision, int(revision))
        return _record(meta, stored)

    async def delete(self, session_id: str, *, tenant: str) -> bool:
        num_deleted: int = await self._db.call(
            lambda: self._client.delete(*self._keys(tenant, session_id)))
        return num_deleted > 0

    async def list(self, *, tenant: str | None = None, limit: int = 100) -> list[SessionRecord]:
        pattern = f"{self.prefix}:meta:*" if tenant is None else \
            f"{self.prefix}:meta:{len(tenant)}:{_glob_escape(tenant)}:*"
        metas = await self._db.call(lambda: self._scan(pattern))
        records = [await self._get_key((k, self._msgs_key(k))) for k in metas]
        live = [r for r in records if r is not None]
        live.sort(key=lambda r: (-r.updated_at, r.session_id))
        return live[:limit]

    async def close(self) -> None:
        await self._db.aclose()

    # --- internals ----------------------------------------------------------------------------

    def _keys(self, tenant: str, session_id: str) -> tuple[str, str]:
        suffix = f"{len(tenant)}:{tenant}:{session_id}"
        return f"{self.prefix}:meta:{suffix}", f"{self.prefix}:msgs:{suffix}"

    async def _scan(self, pattern: str) -> Sequence[str]:
        return [key async for key in self._client.scan_iter(match=pattern, count=500)]

    def _msgs_key(self, meta_key: str) -> str:
        return f"{self.prefix}:msgs:" + meta_key[len(f"{self.prefix}:meta:"):]

    async def _get_key(self, keys: tuple[str, str]) -> SessionRecord | None:
        reply = await self._db.call(lambda: self._read(keys=list(keys)))
        return _record(*reply) if reply else None

    async def _configure(self, client: Any) -> None:
        try:
            await client.config_set("appendonly", "yes")
            await client.config_set("appendfsync", self.appendfsync)
        except ResponseError as exc:
            raise ConfigError(
                f"redis session store {self.url}: cannot set appendfsync={self.appendfsync} "
                f"({exc}); start redis-server with --appendonly yes --appendfsync "
                f"{self.appendfsync} and pass no redis_appendfsync") from exc


def _record(flat: Sequence[str], messages: Sequence[str]) -> SessionRecord:
    """A session from its HGETALL (flat field, value pairs) and its LRANGE."""
    meta = dict(zip(flat[::2], flat[1::2], strict=True))
    return SessionRecord(
        session_id=meta["session_id"], tenant=meta["tenant"],
        messages=tuple(json.loads(m) for m in messages), revision=int(meta["revision"]),
        model=meta["model"], version=meta["version"],
        created_at=float(meta["created_at"]), updated_at=float(meta["updated_at"]))


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def from_url(url: str, options: SessionStoreOptions) -> RedisSessionStore:
    return RedisSessionStore(url, clock=options.clock, appendfsync=options.redis_appendfsync,
                             replicas=options.redis_replicas,
                             replica_timeout_s=options.redis_replica_timeout_s)


__all__ = ["RedisSessionStore", "from_url"]
