"""The Redis pin store: gateways on many machines.

    {prefix}:pin:{session}        HASH instance, expires_at (on the store's clock)
    {prefix}:members:{instance}   ZSET session -> expires_at (for counts)
    {prefix}:instances            SET of instance ids that may hold pins

Every operation is one Lua script, so a compare-and-set is atomic and racing gateways see exactly
one winner. The key also gets a Redis TTL of `ttl_s` past its expiry, only to collect garbage.
"""

from __future__ import annotations

import time
from typing import Any

from strata.clock import Clock
from strata.errors import PinStoreError
from strata.state.pins.base import PinStoreOptions
from strata.state.redis_db import RedisDatabase

# KEYS[1] pin key; ARGV: now, prefix, session
_LIVE = """
local function live(key, now)
  local pin = redis.call('HMGET', key, 'instance', 'expires_at')
  if not pin[1] then return false end
  if tonumber(pin[2]) <= now then
    redis.call('DEL', key)
    redis.call('ZREM', ARGV[2] .. ':members:' .. pin[1], ARGV[3])
    return false
  end
  return pin[1]
end
"""
# ARGV: now, prefix, session, expires_at, ttl_ms
_GET = _LIVE + """
local current = live(KEYS[1], tonumber(ARGV[1]))
if not current then return false end
redis.call('HSET', KEYS[1], 'expires_at', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', ARGV[2] .. ':members:' .. current, ARGV[4], ARGV[3])
return current
"""
# ARGV: now, prefix, session, expires_at, ttl_ms, instance, expected ('' = none)
_SET_IF = _LIVE + """
local current = live(KEYS[1], tonumber(ARGV[1])) or ''
if current ~= ARGV[7] then return 0 end
if current ~= '' and current ~= ARGV[6] then
  redis.call('ZREM', ARGV[2] .. ':members:' .. current, ARGV[3])
end
redis.call('HSET', KEYS[1], 'instance', ARGV[6], 'expires_at', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', ARGV[2] .. ':members:' .. ARGV[6], ARGV[4], ARGV[3])
redis.call('SADD', ARGV[2] .. ':instances', ARGV[6])
return 1
"""
# ARGV: now, prefix, session
_DELETE = """
local instance = redis.call('HGET', KEYS[1], 'instance')
if instance then redis.call('ZREM', ARGV[2] .. ':members:' .. instance, ARGV[3]) end
return redis.call('DEL', KEYS[1])
"""
# ARGV: now, prefix -> flat list instance, count, ...
_COUNTS = """
local result = {}
for _, instance in ipairs(redis.call('SMEMBERS', ARGV[2] .. ':instances')) do
  local key = ARGV[2] .. ':members:' .. instance
  redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[1])
  local count = redis.call('ZCARD', key)
  if count == 0 then
    redis.call('SREM', ARGV[2] .. ':instances', instance)
  else
    table.insert(result, instance)
    table.insert(result, count)
  end
end
return result
"""


class RedisPinStore:
    """A PinStore in a Redis server shared by every gateway using the same URL and prefix."""

    def __init__(self, url: str, *, ttl_s: float = 3600.0, clock: Clock = time.time,
                 prefix: str = "strata:pins") -> None:
        self.url = url
        self.ttl_s = ttl_s
        self.clock = clock
        self.prefix = prefix
        self._db = RedisDatabase(url, error=PinStoreError, what="redis pin store",
                                 decode_responses=True)
        self._scripts: dict[str, Any] = {
            name: self._db.script(text)
            for name, text in (("get", _GET), ("set_if", _SET_IF), ("delete", _DELETE),
                               ("counts", _COUNTS))}

    async def get(self, session_id: str) -> str | None:
        found = await self._script("get", session_id, *self._expiry())
        return str(found) if found else None

    async def set_if(self, session_id: str, instance_id: str, *, expected: str | None) -> bool:
        if not instance_id:
            raise ValueError("instance_id must not be empty")
        written = await self._script("set_if", session_id, *self._expiry(), instance_id,
                                     expected or "")
        return bool(written)

    async def delete(self, session_id: str) -> None:
        await self._script("delete", session_id)

    async def counts(self) -> dict[str, int]:
        args = [repr(self.clock()), self.prefix]
        flat = await self._db.call(lambda: self._scripts["counts"](keys=[], args=args))
        return {str(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def close(self) -> None:
        await self._db.aclose()

    def _expiry(self) -> tuple[str, int]:
        expires_at = self.clock() + self.ttl_s
        return repr(expires_at), int(self.ttl_s * 2000)  # garbage TTL: twice the pin TTL

    async def _script(self, name: str, session_id: str, *extra: Any) -> Any:
        key = f"{self.prefix}:pin:{session_id}"
        args = [repr(self.clock()), self.prefix, session_id, *extra]
        return await self._db.call(lambda: self._scripts[name](keys=[key], args=args))


def from_url(url: str, options: PinStoreOptions) -> RedisPinStore:
    return RedisPinStore(url, ttl_s=options.ttl_s, clock=options.clock,
                         prefix=f"strata:{options.namespace}")


__all__ = ["RedisPinStore", "from_url"]
