"""The Redis response cache: gateways on many machines share answers.

One string key per entry, named by the cache key itself (`infer:{model}:{version}:{hash}`), set
with `SET key value PX ttl_ms`: Redis expires it, so there is nothing to prune. The client keeps
bytes as bytes (no `decode_responses`). Its socket timeouts are short on purpose: the cache sits
on the request path, and a slow or dead Redis must cost a request a miss, not a stall.
"""

from __future__ import annotations

from typing import Any

from strata.errors import ResponseCacheError
from strata.state.redis_db import RedisDatabase
from strata.state.response_cache.base import (
    DEFAULT_MAX_ENTRY_BYTES,
    DEFAULT_TTL_S,
    EntryLimits,
    ResponseCacheOptions,
)


class RedisResponseCache(EntryLimits):
    """A ResponseCache in a Redis server shared by every gateway using the same URL."""

    def __init__(self, url: str, *, ttl_s: float = DEFAULT_TTL_S,
                 max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES, timeout_s: float = 1.0) -> None:
        super().__init__(ttl_s=ttl_s, max_entry_bytes=max_entry_bytes)
        self.url = url
        self._db = RedisDatabase(
            url, error=ResponseCacheError, what="redis response cache", decode_responses=False,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._client: Any = self._db.client

    async def get(self, key: str) -> bytes | None:
        value = await self._db.call(lambda: self._client.get(key))
        return None if value is None else bytes(value)

    async def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> bool:
        ttl = self.admit(value, ttl_s)
        if ttl is None:
            return False
        ttl_ms = max(1, round(ttl * 1000))
        await self._db.call(lambda: self._client.set(key, bytes(value), px=ttl_ms))
        return True

    async def close(self) -> None:
        await self._db.aclose()


def from_url(url: str, options: ResponseCacheOptions) -> RedisResponseCache:
    return RedisResponseCache(url, ttl_s=options.ttl_s, max_entry_bytes=options.max_entry_bytes)


__all__ = ["RedisResponseCache", "from_url"]
