"""The Redis usage store: gateways on many machines add up their counts and share budgets.

    {prefix}:m:{minute}             HASH "{tenant}\\n{counter}\\n{model}" -> count (usage);
                                    expires `retention_s` after its minute
    {prefix}:w:{tenant}:{minute}    HASH requests, tokens (the budget window); expires after
                                    two windows

`add` and `charge` are HINCRBYs in one pipeline; `take` is one Lua script (check both limits,
then count the request), so racing gateways never both take a window's last request.
"""

from __future__ import annotations

import time
from typing import Any

from strata.clock import Clock
from strata.errors import UsageStoreError
from strata.state.redis_db import RedisDatabase
from strata.state.usage.base import WINDOW_S, Counts, UsageKey, UsageStoreOptions, Window, minute_of

# KEYS[1] window; ARGV: max requests (-1: none), max tokens (-1: none), ttl_s
_TAKE = """
local requests = tonumber(redis.call('HGET', KEYS[1], 'requests') or '0')
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
local max_requests, max_tokens = tonumber(ARGV[1]), tonumber(ARGV[2])
if (max_requests >= 0 and requests >= max_requests) or (max_tokens >= 0 and tokens >= max_tokens)
then
  return {0, requests, tokens}
end
requests = redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {1, requests, tokens}
"""


class RedisUsageStore:
    """A UsageStore in a Redis server shared by every gateway using the same URL and prefix."""

    def __init__(self, url: str, *, retention_s: float = 86400.0, clock: Clock = time.time,
                 prefix: str = "strata:usage") -> None:
        self.retention_s = retention_s
        self.clock = clock
        self.prefix = prefix
        self._db = RedisDatabase(url, error=UsageStoreError, what="redis usage store",
                                 decode_responses=True)
        self._take = self._db.script(_TAKE)

    async def add(self, tenant: str, model: str, counts: Counts) -> None:
        minute = minute_of(self.clock())
        key = f"{self.prefix}:m:{minute}"

        async def work() -> None:
            pipe = self._db.client.pipeline(transaction=False)
            for name, value in counts.items():
                pipe.hincrby(key, f"{tenant}\n{name}\n{model}", value)
            pipe.expireat(key, (minute + 1) * WINDOW_S + int(self.retention_s))
            await pipe.execute()

        await self._db.call(work)

    async def totals(self, since_s: float) -> dict[UsageKey, Counts]:
        last = minute_of(self.clock())
        first = max(minute_of(since_s), last - int(self.retention_s // WINDOW_S))

        async def work() -> list[dict[str, str]]:
            pipe = self._db.client.pipeline(transaction=False)
            for minute in range(first, last + 1):
                pipe.hgetall(f"{self.prefix}:m:{minute}")
            return list(await pipe.execute())

        sums: dict[UsageKey, dict[str, int]] = {}
        for rows in await self._db.call(work) if first <= last else []:
            for field, value in rows.items():
                tenant, name, model = field.split("\n", 2)
                row = sums.setdefault((tenant, model), {})
                row[name] = row.get(name, 0) + int(value)
        return {key: Counts.of(row) for key, row in sums.items()}

    async def take(self, tenant: str, *, max_requests: int | None,
                   max_tokens: int | None) -> Window:
        now = self.clock()
        minute = minute_of(now)
        args = [-1 if max_requests is None else max_requests,
                -1 if max_tokens is None else max_tokens, 2 * WINDOW_S]
        reply: list[Any] = await self._db.call(
            lambda: self._take(keys=[self._window_key(tenant, minute)], args=args))
        return Window(bool(int(reply[0])), int(reply[1]), int(reply[2]),
                      (minute + 1) * WINDOW_S - now)

    async def charge(self, tenant: str, num_tokens: int) -> None:
        key = self._window_key(tenant, minute_of(self.clock()))

        async def work() -> None:
            pipe = self._db.client.pipeline(transaction=False)
            pipe.hincrby(key, "tokens", num_tokens)
            pipe.expire(key, 2 * WINDOW_S)
            await pipe.execute()

        await self._db.call(work)

    async def close(self) -> None:
        await self._db.aclose()

    def _window_key(self, tenant: str, minute: int) -> str:
        return f"{self.prefix}:w:{tenant}:{minute}"


def from_url(url: str, options: UsageStoreOptions) -> RedisUsageStore:
    return RedisUsageStore(url, retention_s=options.retention_s, clock=options.clock)


__all__ = ["RedisUsageStore", "from_url"]
