"""The SQLite pin store: gateways on one machine share one file (table `session_{namespace}`).

Every write is one statement, atomic across processes, whose WHERE clause is the
compare-and-set; expiry is a column judged on the store's clock.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from strata.clock import Clock
from strata.errors import PinStoreError
from strata.state.pins.base import PinStoreOptions, check_namespace
from strata.state.sqlite_db import SqliteDatabase, sqlite_path


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


def from_url(url: str, options: PinStoreOptions) -> SqlitePinStore:
    path = sqlite_path(url, what="pin store", example="sqlite:///var/run/strata/sessions.db")
    return SqlitePinStore(path, ttl_s=options.ttl_s, clock=options.clock,
                          namespace=options.namespace)


__all__ = ["SqlitePinStore", "from_url"]
