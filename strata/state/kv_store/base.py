"""The external KV block store: KV payloads keyed by block hash, shared by instances.

A block hash already names the model, version and cache salt (strata/engine/prefix_cache.py),
and a payload is self-describing (strata/model/kv_codec.py), so the store is a plain bounded
cache of bytes: an entry may vanish at any time (TTL, LRU eviction) and a reader treats a missing
block as the end of the usable prefix (block i's KV is useless without blocks 0..i-1).

    memory.py   one process; LRU by bytes (KVStoreLimits.max_bytes)
    redis.py    shared; keys strata:kv:{hex hash}, SET with a TTL; eviction by the server's
                maxmemory-policy (use allkeys-lru on a Redis of its own)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from strata.clock import Clock
from strata.errors import ConfigError, KVStoreUnavailableError
from strata.types import BlockHash

KVItem = tuple[BlockHash, bytes]

@dataclass(frozen=True, slots=True)
class KVStoreLimits:
    """Bounds on what a store keeps. `max_block_bytes` caps one payload; `max_put_bytes` caps
    one `put_many` (its leading blocks are kept, the rest dropped); `max_bytes` is the memory
    backend's capacity (Redis: `redis_maxmemory_bytes`, or the server's own maxmemory)."""

    ttl_s: float | None = 3600.0
    max_block_bytes: int = 16 << 20
    max_put_bytes: int = 256 << 20
    max_bytes: int = 1 << 30
    redis_maxmemory_bytes: int | None = None  # set: CONFIG SET maxmemory + allkeys-lru

    def __post_init__(self) -> None:
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ConfigError(f"kv ttl_s must be positive (or None: no expiry), got {self.ttl_s}")
        for name in ("max_block_bytes", "max_put_bytes", "max_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kv {name} must be positive, got {getattr(self, name)}")
        if self.redis_maxmemory_bytes is not None and self.redis_maxmemory_bytes <= 0:
            raise ConfigError("kv redis_maxmemory_bytes must be positive, got "
                              f"{self.redis_maxmemory_bytes}")

    def admitted(self, items: Sequence[KVItem]) -> list[KVItem]:
        """The leading items within the caps: an oversized block ends the run (later blocks
        would be unreachable without it)."""
        out, total = [], 0
        for item in items:
            size = len(item[1])
            if size > self.max_block_bytes or total + size > self.max_put_bytes:
                break
            out.append(item)
            total += size
        return out


class KVStore(Protocol):
    """Async, safe for concurrent use on one event loop. Errors: `KVStoreUnavailableError`."""

    async def get_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        """Payloads of the longest leading run of `hashes` that the store holds."""
        ...

    async def count_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Length of that run, without transferring payloads."""
        ...

    async def put_many(self, items: Sequence[KVItem]) -> int:
        """Store the leading items within the limits (each with the TTL); returns how many."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class KVStoreOptions:
    """What `create_kv_store` hands every backend's `from_url`: the limits, the clock of the
    memory backend's TTL and the prefix of the Redis backend's keys."""

    limits: KVStoreLimits = field(default_factory=KVStoreLimits)
    clock: Clock = time.monotonic
    key_prefix: str = "strata:kv"


__all__ = ["KVItem", "KVStore", "KVStoreLimits", "KVStoreOptions", "KVStoreUnavailableError"]
