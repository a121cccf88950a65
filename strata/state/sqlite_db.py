"""One SQLite file shared by many processes: the connection every SQLite backend uses.

The registry, the pin store and the session store each keep one autocommit connection
(`isolation_level=None`: every statement is its own short transaction unless the work opens
one), in WAL mode so readers run beside the writer, with `busy_timeout` so writers queue for
the lock instead of failing. The connection is opened on first use and used by one worker
thread at a time; blocking calls run in `asyncio.to_thread`. `sqlite3.Error` leaves as the
backend's own error, naming the file.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from strata.errors import ConfigError

T = TypeVar("T")
_RETRY_SLEEP_S = 0.01
_LOCKED_CODES = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


class SqliteDatabase:
    """A lazily opened, locked SQLite connection to `path` with `schema` applied.

    `schema` is a list of idempotent statements (`CREATE ... IF NOT EXISTS`); `error` builds the
    exception raised for any `sqlite3.Error`, with the message `"{what} {path}: {reason}"`.
    """

    def __init__(self, path: str | Path, *, schema: Sequence[str],
                 error: Callable[[str], Exception], what: str,
                 busy_timeout_ms: int = 10_000) -> None:
        self.path = Path(path)
        self.what = what
        self.busy_timeout_ms = busy_timeout_ms
        self._schema = tuple(schema)
        self._error = error
        self._lock = threading.Lock()  # one connection, used by one worker thread at a time
        self._conn: sqlite3.Connection | None = None

    async def transaction(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`work` inside BEGIN IMMEDIATE: it holds the write lock from its first read, so what
        it reads is what it overwrites; an exception it raises rolls back what it wrote."""
        return await self.call(lambda conn: _in_transaction(conn, work))

    async def call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`work(connection)` in a worker thread, alone on the connection."""
        return await asyncio.to_thread(self._locked, work)

    def _locked(self, work: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            try:
                return work(self._connection())
            except sqlite3.Error as exc:
                raise self._error(f"{self.what} {self.path}: {exc}") from exc

    async def aclose(self) -> None:
        """Close the connection (a later call opens it again)."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Close the connection, waiting for a running call (a later call opens it again)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            timeout_s = self.busy_timeout_ms / 1000
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                   timeout=timeout_s)
            try:
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
                _set_up(conn, self._schema, timeout_s)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn


def _in_transaction(conn: sqlite3.Connection, work: Callable[[sqlite3.Connection], T]) -> T:
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = work(conn)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result


def sqlite_path(url: str, *, what: str, example: str) -> str:
    """The file path of `url` (`sqlite:///ABS/PATH`); a relative or missing path is a
    ConfigError naming `what` (e.g. "pin store") and showing `example`."""
    path = url[len("sqlite://"):]
    if not path.startswith("/") or len(path) < 2:
        raise ConfigError(f"sqlite {what} URL {url!r} needs an absolute path, e.g. {example}")
    return path


def _set_up(conn: sqlite3.Connection, schema: tuple[str, ...], timeout_s: float) -> None:
    """WAL and the schema. Switching to WAL answers "database is locked" at once (the busy
    handler is not consulted) while another connection holds the write lock, e.g. another
    process opening the same new file, so the set-up is retried until `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            for statement in schema:
                conn.execute(statement)
            return
        except sqlite3.OperationalError as exc:
            if not _is_locked(exc) or time.monotonic() > deadline:
                raise
            time.sleep(_RETRY_SLEEP_S)


def _is_locked(exc: sqlite3.OperationalError) -> bool:
    """True for SQLITE_BUSY / SQLITE_LOCKED (extended codes included): worth a retry."""
    return (exc.sqlite_errorcode & 0xFF) in _LOCKED_CODES


__all__ = ["SqliteDatabase", "sqlite_path"]
