"""The Redis KV block store: every instance pointing at one Redis shares fetched KV.

One key per block, `{prefix}:{hex hash}` -> payload, written with SET PX (the TTL counts from
the last write; a republished block is refreshed). A fetch reads in chunks of MGET and stops at
the first missing block, so a cold prefix costs one round trip. Memory is bounded by the
server: run the KV store on a Redis of its own with `maxmemory` and
`maxmemory-policy allkeys-lru` (`redis_maxmemory_bytes` sets both with CONFIG SET) — on a Redis
shared with the session store, allkeys-lru could evict sessions.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from strata.errors import ConfigError, KVStoreUnavailableError
from strata.state.kv_store.base import KVItem, KVStoreLimits, KVStoreOptions
from strata.state.redis_db import RedisDatabase
from strata.types import BlockHash

_MGET_CHUNK = 16  # blocks per round trip of a fetch


class RedisKVStore:
    """A KVStore in one Redis node."""

    def __init__(self, url: str, limits: KVStoreLimits, *, key_prefix: str = "strata:kv") -> None:
        self.url = url
        self.limits = limits
        self.key_prefix = key_prefix
        self._db = RedisDatabase(
            url, error=KVStoreUnavailableError, what="redis KV store",
            setup=None if limits.redis_maxmemory_bytes is None else self._configure,
            socket_connect_timeout=2.0, socket_timeout=10.0)
        self._client: Any = self._db.client

    async def get_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        keys = [self._key(h) for h in hashes]
        out: list[bytes] = []
        for start in range(0, len(keys), _MGET_CHUNK):
            values = await self._db.call(self._mget(keys[start : start + _MGET_CHUNK]))
            for value in values:
                if value is None:
                    return out
                out.append(value)
        return out

    async def count_prefix(self, hashes: Sequence[BlockHash]) -> int:
        if not hashes:
            return 0

        async def exists() -> list[int]:
            pipe = self._client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.exists(self._key(block_hash))
            result: list[int] = await pipe.execute()
            return result

        found = await self._db.call(exists)
        return next((i for i, n in enumerate(found) if not n), len(found))

    async def put_many(self, items: Sequence[KVItem]) -> int:
        admitted = self.limits.admitted(items)
        if not admitted:
            return 0
        ttl_ms = None if self.limits.ttl_s is None else max(1, round(self.limits.ttl_s * 1000))

        async def put() -> None:
            pipe = self._client.pipeline(transaction=False)
            for block_hash, payload in admitted:
                pipe.set(self._key(block_hash), payload, px=ttl_ms)
            await pipe.execute()

        await self._db.call(put)
        return len(admitted)

    async def close(self) -> None:
        await self._db.aclose()

    def _mget(self, keys: list[str]) -> Callable[[], Awaitable[list[bytes | None]]]:
        return lambda: self._client.mget(keys)  # type: ignore[no-any-return]

    def _key(self, block_hash: BlockHash) -> str:
        return f"{self.key_prefix}:{block_hash.hex()}"

    async def _configure(self, client: Any) -> None:
        try:
            await client.config_set("maxmemory", str(self.limits.redis_maxmemory_bytes))
            await client.config_set("maxmemory-policy", "allkeys-lru")
        except ResponseError as exc:
            raise ConfigError(
                f"redis KV store {self.url}: cannot set maxmemory ({exc}); start redis-server "
                "with --maxmemory N --maxmemory-policy allkeys-lru instead") from exc


def from_url(url: str, options: KVStoreOptions) -> RedisKVStore:
    return RedisKVStore(url, options.limits, key_prefix=options.key_prefix)


__all__ = ["RedisKVStore", "from_url"]
