"""The SQLite response cache: gateways on one machine share one file (table `response_cache`).

Each put runs in one BEGIN IMMEDIATE transaction that prunes expired rows, writes the entry and
then drops the oldest stored rows past `max_bytes`.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from strata.errors import ResponseCacheError
from strata.state.response_cache.base import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRY_BYTES,
    DEFAULT_TTL_S,
    Clock,
    EntryLimits,
    ResponseCacheOptions,
)
from strata.state.sqlite_db import SqliteDatabase, sqlite_path

T = TypeVar("T")
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


def from_url(url: str, options: ResponseCacheOptions) -> SqliteResponseCache:
    path = sqlite_path(url, what="response cache", example="sqlite:///var/lib/strata/responses.db")
    return SqliteResponseCache(path, ttl_s=options.ttl_s, max_bytes=options.max_bytes,
                               max_entry_bytes=options.max_entry_bytes, clock=options.clock)


__all__ = ["SqliteResponseCache", "from_url"]
