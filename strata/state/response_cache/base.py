"""The response cache: finished answers to deterministic requests, by key, for a while.

Contract (one test suite runs it over all three backends):
- Values are opaque bytes, stored and returned byte for byte (never pickled, never decoded).
- `put(key, value, ttl_s=t)` stores `value` for `t` seconds (None: the cache's own `ttl_s`);
  a later `put` of the same key replaces it. After its TTL an entry reads as absent.
- A value longer than `max_entry_bytes` is not stored: `put` answers False and counts it in
  `num_too_large` (answers are small; one huge one should not evict everything else).
- The cache is bounded: memory evicts the least recently used entries past `max_bytes` or
  `max_entries`; SQLite drops expired rows and then the oldest stored ones past `max_bytes` on
  each put; Redis relies on the TTL (bound the server with `maxmemory` + `allkeys-lru`).
- Any backend failure (connection refused, disk error) raises ResponseCacheError, never the
  driver's own exception, so a caller can catch one type and carry on uncached.
- Keys carry the model version (`infer:{model}:{version}:{hash}`), so a new version never
  reads an old version's entries; nothing here needs to know that.

TTL is judged on the injected clock for memory and SQLite; Redis uses the server's expiry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from strata.clock import Clock
from strata.errors import ConfigError, ResponseCacheError

DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_ENTRY_BYTES = 1024 * 1024
DEFAULT_MAX_ENTRIES = 100_000

class ResponseCache(Protocol):
    """Bytes by key with a TTL; memory, SQLite (WAL) and Redis pass one contract."""

    num_too_large: int  # puts refused because the value exceeded max_entry_bytes

    async def get(self, key: str) -> bytes | None:
        """The live value of `key`, or None (never stored, expired or evicted)."""
        ...

    async def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> bool:
        """Store `value` under `key` for `ttl_s` (None: the cache's default); False when the
        value is over `max_entry_bytes` and was not stored."""
        ...

    async def close(self) -> None:
        """Release connections; the cache is unusable afterwards."""
        ...


class EntryLimits:
    """TTL and entry-size rules shared by every backend."""

    def __init__(self, *, ttl_s: float, max_entry_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.max_entry_bytes = max_entry_bytes
        self.num_too_large = 0

    def admit(self, value: bytes, ttl_s: float | None) -> float | None:
        """The TTL to store `value` with, or None (counted) when it is too large to store."""
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"response cache ttl_s must be positive or None, got {ttl_s}")
        if len(value) > self.max_entry_bytes:
            self.num_too_large += 1
            return None
        return self.ttl_s if ttl_s is None else ttl_s


@dataclass(frozen=True, slots=True)
class ResponseCacheOptions:
    """What `create_response_cache` hands every backend's `from_url`. Entries live `ttl_s` by
    default; `max_bytes` bounds memory and SQLite, `max_entries` memory; Redis is bounded by
    the server's `maxmemory`."""

    ttl_s: float = DEFAULT_TTL_S
    max_bytes: int = DEFAULT_MAX_BYTES
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES
    max_entries: int = DEFAULT_MAX_ENTRIES
    clock: Clock = time.time

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ConfigError(f"response cache ttl_s must be positive, got {self.ttl_s}")
        if self.max_entry_bytes <= 0 or self.max_bytes < self.max_entry_bytes:
            raise ConfigError(f"response cache needs 0 < max_entry_bytes <= max_bytes, got "
                              f"max_entry_bytes={self.max_entry_bytes}, "
                              f"max_bytes={self.max_bytes}")
        if self.max_entries <= 0:
            raise ConfigError(
                f"response cache max_entries must be positive, got {self.max_entries}")


__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_ENTRIES", "DEFAULT_MAX_ENTRY_BYTES", "DEFAULT_TTL_S",
           "EntryLimits", "ResponseCache", "ResponseCacheError", "ResponseCacheOptions"]
