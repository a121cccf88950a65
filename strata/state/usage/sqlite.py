"""The SQLite usage store: gateways on one machine share one file (tables `usage` and
`usage_windows`).

    usage           (minute, tenant, model) -> the counters of base.COUNTERS; `add` is one
                    upsert that adds (atomic across processes); minutes past the retention are
                    deleted by the first `add` of each new minute
    usage_windows   tenant -> (minute, requests, tokens): the budget window; `take` reads and
                    writes it inside BEGIN IMMEDIATE (the write lock held from the read, so two
                    gateways never both take the last request); `charge` is one upsert
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from strata.clock import Clock
from strata.errors import UsageStoreError
from strata.state.sqlite_db import SqliteDatabase, sqlite_path
from strata.state.usage.base import (
    COUNTERS,
    WINDOW_S,
    Counts,
    UsageKey,
    UsageStoreOptions,
    Window,
    minute_of,
)

_COLUMNS = ", ".join(COUNTERS)
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS usage (minute INTEGER NOT NULL, tenant TEXT NOT NULL, "
    "model TEXT NOT NULL, " + ", ".join(f"{c} INTEGER NOT NULL" for c in COUNTERS)
    + ", PRIMARY KEY (minute, tenant, model))",
    "CREATE TABLE IF NOT EXISTS usage_windows (tenant TEXT PRIMARY KEY, minute INTEGER NOT NULL, "
    "requests INTEGER NOT NULL, tokens INTEGER NOT NULL)",
)
_ADD = (f"INSERT INTO usage (minute, tenant, model, {_COLUMNS}) "
        f"VALUES (?, ?, ?, {', '.join('?' for _ in COUNTERS)}) "
        "ON CONFLICT (minute, tenant, model) DO UPDATE SET "
        + ", ".join(f"{c} = {c} + excluded.{c}" for c in COUNTERS))
_TOTALS = (f"SELECT tenant, model, {', '.join(f'SUM({c})' for c in COUNTERS)} FROM usage "
           "WHERE minute >= ? GROUP BY tenant, model")
_CHARGE = ("INSERT INTO usage_windows VALUES (?1, ?2, 0, ?3) ON CONFLICT (tenant) DO UPDATE SET "
           "requests = CASE WHEN minute = ?2 THEN requests ELSE 0 END, "
           "tokens = CASE WHEN minute = ?2 THEN tokens + ?3 ELSE ?3 END, minute = ?2")


class SqliteUsageStore:
    """A UsageStore in a SQLite file (WAL) shared by every process that opens the same path."""

    def __init__(self, path: str | Path, *, retention_s: float = 86400.0,
                 clock: Clock = time.time, busy_timeout_ms: int = 10_000) -> None:
        self.path = Path(path)
        self.retention_s = retention_s
        self.clock = clock
        self._db = SqliteDatabase(self.path, schema=SCHEMA, error=UsageStoreError,
                                  what="sqlite usage store", busy_timeout_ms=busy_timeout_ms)
        self._pruned_minute = -1  # the minute this client last deleted old usage in

    async def add(self, tenant: str, model: str, counts: Counts) -> None:
        minute = minute_of(self.clock())
        values = (minute, tenant, model, *(getattr(counts, c) for c in COUNTERS))
        oldest = minute - int(self.retention_s // WINDOW_S)
        prune = minute != self._pruned_minute
        self._pruned_minute = minute

        def work(conn: sqlite3.Connection) -> None:
            conn.execute(_ADD, values)
            if prune:
                conn.execute("DELETE FROM usage WHERE minute < ?", (oldest,))

        await self._db.call(work)

    async def totals(self, since_s: float) -> dict[UsageKey, Counts]:
        oldest = minute_of(self.clock()) - int(self.retention_s // WINDOW_S)
        first = max(minute_of(since_s), oldest)
        rows = await self._db.call(lambda conn: conn.execute(_TOTALS, (first,)).fetchall())
        return {(str(tenant), str(model)): Counts(*(int(v) for v in sums))
                for tenant, model, *sums in rows}

    async def take(self, tenant: str, *, max_requests: int | None,
                   max_tokens: int | None) -> Window:
        now = self.clock()
        minute = minute_of(now)

        def work(conn: sqlite3.Connection) -> Window:
            row = conn.execute("SELECT minute, requests, tokens FROM usage_windows "
                               "WHERE tenant = ?", (tenant,)).fetchone()
            num_requests, num_tokens = (int(row[1]), int(row[2])) if row and row[0] == minute \
                else (0, 0)
            is_admitted = ((max_requests is None or num_requests < max_requests)
                           and (max_tokens is None or num_tokens < max_tokens))
            if is_admitted:
                num_requests += 1
                conn.execute("INSERT INTO usage_windows VALUES (?1, ?2, ?3, ?4) "
                             "ON CONFLICT (tenant) DO UPDATE SET minute = ?2, requests = ?3, "
                             "tokens = ?4", (tenant, minute, num_requests, num_tokens))
            return Window(is_admitted, num_requests, num_tokens, (minute + 1) * WINDOW_S - now)

        return await self._db.transaction(work)

    async def charge(self, tenant: str, num_tokens: int) -> None:
        params: tuple[Any, ...] = (tenant, minute_of(self.clock()), num_tokens)
        await self._db.call(lambda conn: conn.execute(_CHARGE, params))

    async def close(self) -> None:
        await self._db.aclose()


def from_url(url: str, options: UsageStoreOptions) -> SqliteUsageStore:
    path = sqlite_path(url, what="usage store", example="sqlite:///var/run/strata/usage.db")
    return SqliteUsageStore(path, retention_s=options.retention_s, clock=options.clock)


__all__ = ["SqliteUsageStore", "from_url"]
