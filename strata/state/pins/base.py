"""The session pin table: which instance a session sticks to, shared by every gateway.

    create_pin_store("memory://")                 one gateway (tests)
    create_pin_store("sqlite:///abs/path.db")     gateways on one machine (table `session_pins`)
    create_pin_store("redis://127.0.0.1:6379/0")  gateways on many machines (keys `strata:pins:*`)

Contract (one test suite runs it over all three backends):
- `set_if(session, instance, expected=e)` is a compare-and-set: it writes only when the current
  pin equals `e` (None = no live pin), atomically across processes; of racing writers exactly one
  wins. Writing the pin it already has (e == instance) refreshes its expiry.
- A pin expires `ttl_s` after it was last written or read (`get` slides the expiry), so idle
  sessions unpin; expiry is judged on the store's injected clock (wall time by default, shared by
  every process), never on Redis key TTLs alone.
- `counts()` is the number of live pins per instance (the bounded-load input of every gateway).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from strata.errors import ConfigError, StrataError
from strata.state.sqlite_db import SqliteDatabase, sqlite_path

T = TypeVar("T")
Clock = Callable[[], float]
SCHEMES = ("memory://", "sqlite:///PATH", "redis://HOST:PORT/DB", "rediss://HOST:PORT/DB")


class PinStoreError(StrataError):
    """The pin store could not be reached or answered an error."""


class PinStore(Protocol):
    """Session id -> instance id, with compare-and-set writes and sliding expiry."""

    async def get(self, session_id: str) -> str | None:
        """The live pin of `session_id` (and its expiry slides), or None."""
        ...

    async def set_if(self, session_id: str, instance_id: str, *, expected: str | None) -> bool:
        """Pin `session_id` to `instance_id` if its live pin is `expected`; True if written."""
        ...

    async def delete(self, session_id: str) -> None:
        """Unpin `session_id` (no error when it had no pin)."""
        ...

    async def counts(self) -> dict[str, int]:
        """Live pins per instance id (instances with none are absent)."""
        ...

    async def close(self) -> None:
        ...


class MemoryPinStore:
    """A PinStore in this process (single-threaded asyncio: no awaits inside an operation)."""

    def __init__(self, *, ttl_s: float = 3600.0, clock: Clock = time.time) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._pins: dict[str, tuple[str, float]] = {}  # session -> (instance, expires_at)

    def _live(self, session_id: str) -> str | None:
        pin = self._pins.get(session_id)
        if pin is None or pin[1] <= self.clock():
            self._pins.pop(session_id, None)
            return None
        return pin[0]

    async def get(self, session_id: str) -> str | None:
        instance_id = self._live(session_id)
        if instance_id is not None:
            self._pins[session_id] = (instance_id, self.clock() + self.ttl_s)
        return instance_id

    async def set_if(self, session_id: str, instance_id: str, *, expected: str | None) -> bool:
        if self._live(session_id) != expected:
            return False
        self._pins[session_id] = (instance_id, self.clock() + self.ttl_s)
        return True

    async def delete(self, session_id: str) -> None:
        self._pins.pop(session_id, None)

    async def counts(self) -> dict[str, int]:
        now = self.clock()
        result: dict[str, int] = {}
        for instance_id, expires_at in self._pins.values():
            if expires_at > now:
                result[instance_id] = result.get(instance_id, 0) + 1
        return result

    async def close(self) -> None:
        return None


def _sql(namespace: str) -> dict[str, Any]:
    """The statements over table `session_{namespace}`; every write is one statement (atomic
    across processes) and the WHERE clauses are the compare-and-set."""
    t = f"session_{namespace}"
    return {
        "schema": (f"CREATE TABLE IF NOT EXISTS {t} (session_id TEXT PRIMARY KEY, "
                   "instance_id TEXT NOT NULL, expires_at REAL NOT NULL)",
                   f"CREATE INDEX IF NOT EXISTS {t}_by_instance ON {t} (instance_id)"),
        "create": (f"INSERT INTO {t} VALUES (?1, ?2, ?3) ON CONFLICT(session_id) DO UPDATE "
                   f"SET instance_id = ?2, expires_at = ?3 WHERE {t}.expires_at <= ?4"),
        "swap": (f"UPDATE {t} SET instance_id = ?2, expires_at = ?3 "
                 "WHERE session_id = ?1 AND instance_id = ?5 AND expires_at > ?4"),
        "get": (f"UPDATE {t} SET expires_at = ?2 WHERE session_id = ?1 AND expires_at > ?3 "
                "RETURNING instance_id"),
        "delete": f"DELETE FROM {t} WHERE session_id = ?",
        "expire": f"DELETE FROM {t} WHERE expires_at <= ?",
        "counts": (f"SELECT instance_id, COUNT(*) FROM {t} WHERE expires_at > ? "
                   "GROUP BY instance_id"),
    }


def check_namespace(namespace: str) -> str:
    if not namespace.isidentifier() or not namespace.isascii():
        raise ConfigError(f"pin store namespace must be a plain identifier, got {namespace!r}")
    return namespace


class SqlitePinStore:
    """A PinStore in a SQLite file (WAL) shared by every process that opens the same path."""

    def __init__(self, path: str | Path, *, ttl_s: float = 3600.0, clock: Clock = time.time,
                 busy_timeout_ms: int = 10_000, namespace: str = "pins") -> None:
        self.path = Path(path)
        self.ttl_s = ttl_s
        self.clock = clock
        self._sql = _sql(check_namespace(namespace))
        self._db = SqliteDatabase(self.path, schema=self._sql["schema"], error=PinStoreError,
                                  what="sqlite pin store", busy_timeout_ms=busy_timeout_ms)

    async def get(self, session_id: str) -> str | None:
        now = self.clock()
        rows = await self._run(self._sql["get"], (session_id, now + self.ttl_s, now), fetch=True)
        return str(rows[0][0]) if rows else None

    async def set_if(self, session_id: str, instance_id: str, *, expected: str | None) -> bool:
        now = self.clock()
        params: tuple[Any, ...] = (session_id, instance_id, now + self.ttl_s, now)
        if expected is None:
            return bool(await self._run(self._sql["create"], params))
        return bool(await self._run(self._sql["swap"], (*params, expected)))

    async def delete(self, session_id: str) -> None:
        await self._run(self._sql["delete"], (session_id,))

    async def counts(self) -> dict[str, int]:
        now = self.clock()
        await self._run(self._sql["expire"], (now,))
        rows = await self._run(self._sql["counts"], (now,), fetch=True)
        return {str(instance_id): int(count) for instance_id, count in rows}

    async def close(self) -> None:
        await self._db.aclose()

    async def _run(self, sql: str, params: tuple[Any, ...], *, fetch: bool = False) -> Any:
        """One statement in its own transaction: the rows (fetch) or the rows changed."""
        def work(conn: sqlite3.Connection) -> Any:
            cursor = conn.execute(sql, params)
            return cursor.fetchall() if fetch else cursor.rowcount

        return await self._db.call(work)


def create_pin_store(url: str, *, ttl_s: float = 3600.0, clock: Clock = time.time,
                     namespace: str = "pins") -> PinStore:
    """The pin store named by `url`'s scheme; pins expire `ttl_s` after their last use.
    `namespace` separates tables of pins in one store: "pins" (session -> instance, the sticky
    routing table) and "versions" (session -> model version) share a backend, not their keys."""
    if ttl_s <= 0:
        raise ConfigError(f"pin ttl_s must be positive, got {ttl_s}")
    check_namespace(namespace)
    if url in ("memory://", "memory"):
        return MemoryPinStore(ttl_s=ttl_s, clock=clock)
    if url.startswith("sqlite://"):
        path = sqlite_path(url, what="pin store",
                           example="sqlite:///var/run/strata/sessions.db")
        return SqlitePinStore(path, ttl_s=ttl_s, clock=clock, namespace=namespace)
    if url.startswith(("redis://", "rediss://")):
        from strata.state.pins_redis import RedisPinStore  # lazy: redis is only needed here

        return RedisPinStore(url, ttl_s=ttl_s, clock=clock, prefix=f"strata:{namespace}")
    raise ConfigError(f"unknown session store URL {url!r}; use one of: {', '.join(SCHEMES)}")


async def call_redis(url: str, work: Awaitable[T]) -> T:
    """`work`, with Redis errors raised as PinStoreError."""
    from redis.exceptions import RedisError

    try:
        return await work
    except RedisError as exc:
        raise PinStoreError(f"redis pin store {url}: {exc}") from exc


__all__ = ["SCHEMES", "MemoryPinStore", "PinStore", "PinStoreError", "SqlitePinStore",
           "call_redis", "create_pin_store"]
