"""The SQLite session store: one file shared by every process on one machine.

One row per session, its messages one JSON array column. An append reads the row and writes it
back with `UPDATE ... WHERE revision = ?` (a create is an INSERT that may only replace an
expired row), so a writer that lost the race changes no row and gets SessionConflictError, even
across processes. WAL lets readers run beside the writer; `busy_timeout` makes writers queue for
the lock. Blocking calls run in a worker thread (`asyncio.to_thread`), one at a time.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from strata.errors import SessionStoreUnavailableError
from strata.state.sessions.base import (
    Clock,
    Message,
    SessionRecord,
    SessionStoreOptions,
    cas_failure,
    check_append,
)
from strata.state.sqlite_db import SqliteDatabase, sqlite_path

T = TypeVar("T")
_SCHEMA = """CREATE TABLE IF NOT EXISTS sessions (
    tenant TEXT NOT NULL, session_id TEXT NOT NULL, revision INTEGER NOT NULL,
    model TEXT NOT NULL, version TEXT NOT NULL, created_at REAL NOT NULL,
    updated_at REAL NOT NULL, expires_at REAL, messages TEXT NOT NULL,
    PRIMARY KEY (tenant, session_id))"""
_COLUMNS = "session_id, tenant, messages, revision, model, version, created_at, updated_at"
_LIVE = "(expires_at IS NULL OR expires_at > ?)"
_CREATE = (
    "INSERT INTO sessions (tenant, session_id, revision, model, version, created_at, updated_at,"
    " expires_at, messages) VALUES (?, ?, 1, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (tenant, session_id) DO UPDATE SET revision = 1, model = excluded.model,"
    " version = excluded.version, created_at = excluded.created_at,"
    " updated_at = excluded.updated_at, expires_at = excluded.expires_at,"
    " messages = excluded.messages "
    "WHERE sessions.expires_at IS NOT NULL AND sessions.expires_at <= excluded.created_at")
_UPDATE = (
    "UPDATE sessions SET revision = revision + 1, model = ?, version = ?, updated_at = ?,"
    " expires_at = ?, messages = ? "
    f"WHERE tenant = ? AND session_id = ? AND revision = ? AND {_LIVE}")


class SqliteSessionStore:
    """A SessionStore in a SQLite file (WAL)."""

    def __init__(self, path: str | Path, *, clock: Clock = time.time,
                 busy_timeout_ms: int = 10_000) -> None:
        self.path = Path(path)
        self.clock = clock
        self._db = SqliteDatabase(self.path, schema=[_SCHEMA], error=SessionStoreUnavailableError,
                                  what="sqlite session store", busy_timeout_ms=busy_timeout_ms)

    async def get(self, session_id: str, *, tenant: str) -> SessionRecord | None:
        rows = await self._db.call(lambda c: c.execute(
            f"SELECT {_COLUMNS} FROM sessions WHERE tenant = ? AND session_id = ? AND {_LIVE}",
            (tenant, session_id, self.clock())).fetchall())
        return _decode(rows[0]) if rows else None

    async def append(self, session_id: str, *, tenant: str, expected_revision: int,
                     messages: Sequence[Message], model: str, version: str,
                     ttl_s: float | None) -> SessionRecord:
        check_append(session_id, tenant, expected_revision, ttl_s)
        added = json.loads(json.dumps(list(messages)))

        def work(conn: sqlite3.Connection) -> SessionRecord:
            now = self.clock()
            expires_at = None if ttl_s is None else now + ttl_s
            if expected_revision == 0:
                changed = conn.execute(_CREATE, (tenant, session_id, model, version, now, now,
                                                 expires_at, json.dumps(added))).rowcount
            else:
                changed = _update(conn, (tenant, session_id), expected_revision, added,
                                  (model, version, now, expires_at))
            row = _row(conn, tenant, session_id, now)
            if not changed or row is None:
                raise cas_failure(session_id, expected_revision, 0 if row is None else row[3])
            return _decode(row)

        return await self._db.transaction(work)

    async def delete(self, session_id: str, *, tenant: str) -> bool:
        changed: int = await self._db.call(lambda c: c.execute(
            f"DELETE FROM sessions WHERE tenant = ? AND session_id = ? AND {_LIVE}",
            (tenant, session_id, self.clock())).rowcount)
        return changed > 0

    async def list(self, *, tenant: str | None = None, limit: int = 100) -> list[SessionRecord]:
        where = f"WHERE {_LIVE}"
        params: list[Any] = [self.clock()]
        if tenant is not None:
            where, params = where + " AND tenant = ?", [*params, tenant]
        rows = await self._db.call(lambda c: c.execute(
            f"SELECT {_COLUMNS} FROM sessions {where} ORDER BY updated_at DESC, session_id "
            "LIMIT ?", (*params, limit)).fetchall())
        return [_decode(row) for row in rows]

    async def close(self) -> None:
        await self._db.aclose()


def _update(conn: sqlite3.Connection, key: tuple[str, str], expected_revision: int,
            added: list[Message], fields: tuple[str, str, float, float | None]) -> int:
    """The compare-and-set: the new messages are computed from the row read at
    `expected_revision`; the UPDATE only lands if the row still has that revision."""
    tenant, session_id = key
    model, version, now, expires_at = fields
    row = _row(conn, tenant, session_id, now)
    if row is None or row[3] != expected_revision:
        return 0
    messages = json.dumps([*json.loads(row[2]), *added])
    changed: int = conn.execute(_UPDATE, (model, version, now, expires_at, messages, tenant,
                                          session_id, expected_revision, now)).rowcount
    return changed


def _row(conn: sqlite3.Connection, tenant: str, session_id: str,
         now: float) -> tuple[Any, ...] | None:
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM sessions WHERE tenant = ? AND session_id = ? AND {_LIVE}",
        (tenant, session_id, now)).fetchall()
    return tuple(rows[0]) if rows else None


def _decode(row: tuple[Any, ...]) -> SessionRecord:
    session_id, tenant, messages, revision, model, version, created_at, updated_at = row
    return SessionRecord(session_id, tenant, tuple(json.loads(messages)), int(revision),
                         model, version, float(created_at), float(updated_at))


def from_url(url: str, options: SessionStoreOptions) -> SqliteSessionStore:
    path = sqlite_path(url, what="session store", example="sqlite:///var/lib/strata/sessions.db")
    return SqliteSessionStore(path, clock=options.clock)


__all__ = ["SqliteSessionStore", "from_url"]
