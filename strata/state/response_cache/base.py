"""The response cache: finished answers to deterministic requests, by key, for a while.

    create_response_cache("memory://")                 one gateway (LRU in this process)
    create_response_cache("sqlite:///abs/path.db")     gateways on one machine (`response_cache`)
    create_response_cache("redis://127.0.0.1:6379/0")  gateways on many machines (key = cache key)

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

import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from strata.errors import ConfigError, StrataError
from strata.state.sqlite_db import SqliteDatabase, sqlite_path

T = TypeVar("T")
Clock = Callable[[], float]
SCHEMES = ("memory://", "sqlite:///ABS/PATH.db", "redis://HOST:PORT/DB", "rediss://HOST:PORT/DB")
DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_ENTRY_BYTES = 1024 * 1024
DEFAULT_MAX_ENTRIES = 100_000


class ResponseCacheError(StrataError):
    """The response cache's backend could not be reached or answered an error."""


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


class MemoryResponseCache(EntryLimits):
    """A ResponseCache in this process: LRU by total bytes and entries (single-threaded asyncio:
    no awaits inside an operation)."""

    def __init__(self, *, ttl_s: float = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
                 max_entries: int = DEFAULT_MAX_ENTRIES, clock: Clock = time.time) -> None:
        super().__init__(ttl_s=ttl_s, max_entry_bytes=max_entry_bytes)
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.clock = clock
        self.num_bytes = 0  # invariant: the sum of len(value) over _entries
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return entry[0]

    async def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> bool:
        ttl = self.admit(value, ttl_s)
        if ttl is None:
            return False
        self._remove(key)
        self._entries[key] = (bytes(value), self.clock() + ttl)
        self.num_bytes += len(value)
        while self.num_bytes > self.max_bytes or len(self._entries) > self.max_entries:
            self._remove(next(iter(self._entries)))
        return True

    async def close(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= len(entry[0])


_SQL_SCHEMA = ("CREATE TABLE IF NOT EXISTS response_cache (key TEXT PRIMARY KEY,"
               " value BLOB NOT NULL, num_bytes INTEGER NOT NULL, stored_at REAL NOT NULL,"
               " expires_at REAL NOT NULL)",
               "CREATE INDEX IF NOT EXISTS response_cache_by_expiry ON response_cache (expires_at)")
_SQL_PUT = ("INSERT INTO response_cache VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT(key) DO UPDATE "
            "SET value = ?2, num_bytes = ?3, stored_at = ?4, expires_at = ?5")
# the newest rows whose running total fits in max_bytes stay; the rest (oldest) go
_SQL_EVICT = ("DELETE FROM response_cache WHERE key IN (SELECT key FROM (SELECT key, "
              "SUM(num_bytes) OVER (ORDER BY stored_at DESC, key) AS total FROM response_cache) "
              "WHERE total > ?)")


class SqliteResponseCache(EntryLimits):
    """A ResponseCache in a SQLite file (WAL) shared by every process that opens the same path.
    Each put prunes expired rows, then the oldest stored rows past `max_bytes`."""

    def __init__(self, path: str | Path, *, ttl_s: float = DEFAULT_TTL_S,
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES, clock: Clock = time.time,
                 busy_timeout_ms: int = 10_000) -> None:
        super().__init__(ttl_s=ttl_s, max_entry_bytes=max_entry_bytes)
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.clock = clock
        self._db = SqliteDatabase(self.path, schema=_SQL_SCHEMA, error=ResponseCacheError,
                                  what="sqlite response cache", busy_timeout_ms=busy_timeout_ms)

    async def get(self, key: str) -> bytes | None:
        rows = await self._call(lambda c: c.execute(
            "SELECT value FROM response_cache WHERE key = ? AND expires_at > ?",
            (key, self.clock())).fetchall())
        return bytes(rows[0][0]) if rows else None

    async def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> bool:
        ttl = self.admit(value, ttl_s)
        if ttl is None:
            return False
        now = self.clock()

        def work(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("DELETE FROM response_cache WHERE expires_at <= ?", (now,))
                conn.execute(_SQL_PUT, (key, sqlite3.Binary(value), len(value), now, now + ttl))
                conn.execute(_SQL_EVICT, (self.max_bytes,))
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

        await self._call(work)
        return True

    async def close(self) -> None:
        await self._db.aclose()

    async def _call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`work` on the connection; an OSError (the directory cannot be made) is the cache's
        error too (sqlite3 errors already are)."""
        try:
            return await self._db.call(work)
        except OSError as exc:
            raise ResponseCacheError(f"sqlite response cache {self.path}: {exc}") from exc


def create_response_cache(url: str, *, ttl_s: float = DEFAULT_TTL_S,
                          max_bytes: int = DEFAULT_MAX_BYTES,
                          max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
                          max_entries: int = DEFAULT_MAX_ENTRIES,
                          clock: Clock = time.time) -> ResponseCache:
    """The backend named by `url`'s scheme. Entries live `ttl_s` by default; `max_bytes` bounds
    memory and SQLite, `max_entries` memory; Redis is bounded by the server's `maxmemory`."""
    _check_limits(ttl_s, max_bytes, max_entry_bytes, max_entries)
    sizes: dict[str, Any] = {"ttl_s": ttl_s, "max_entry_bytes": max_entry_bytes}
    if url in ("memory://", "memory"):
        return MemoryResponseCache(**sizes, max_bytes=max_bytes, max_entries=max_entries,
                                   clock=clock)
    if url.startswith("sqlite://"):
        path = sqlite_path(url, what="response cache",
                           example="sqlite:///var/lib/strata/responses.db")
        return SqliteResponseCache(path, **sizes, max_bytes=max_bytes, clock=clock)
    if url.startswith(("redis://", "rediss://")):
        from strata.state.response_cache_redis import RedisResponseCache  # redis only here

        return RedisResponseCache(url, **sizes)
    raise ConfigError(f"unknown response cache URL {url!r}; use one of: {', '.join(SCHEMES)}")


def _check_limits(ttl_s: float, max_bytes: int, max_entry_bytes: int, max_entries: int) -> None:
    if ttl_s <= 0:
        raise ConfigError(f"response cache ttl_s must be positive, got {ttl_s}")
    if max_entry_bytes <= 0 or max_bytes < max_entry_bytes:
        raise ConfigError(f"response cache needs 0 < max_entry_bytes <= max_bytes, got "
                          f"max_entry_bytes={max_entry_bytes}, max_bytes={max_bytes}")
    if max_entries <= 0:
        raise ConfigError(f"response cache max_entries must be positive, got {max_entries}")


__all__ = ["SCHEMES", "EntryLimits", "MemoryResponseCache", "ResponseCache", "ResponseCacheError",
           "SqliteResponseCache", "create_response_cache"]
