"""SqliteDatabase: the shared connection of the SQLite backends (registry, pins, sessions)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from strata.errors import ConfigError, StrataError
from strata.state.sqlite_db import SqliteDatabase, sqlite_path

SCHEMA = ("CREATE TABLE IF NOT EXISTS items (name TEXT PRIMARY KEY)",
          "CREATE INDEX IF NOT EXISTS items_by_name ON items (name)")


class ItemsError(StrataError):
    """The error a backend raises for its SQLite failures (here: the test's own)."""


def _db(path: Path) -> SqliteDatabase:
    return SqliteDatabase(path, schema=SCHEMA, error=ItemsError, what="sqlite items",
                          busy_timeout_ms=10_000)


def _insert(db: SqliteDatabase, name: str) -> int:
    return asyncio.run(db.call(
        lambda c: c.execute("INSERT INTO items VALUES (?)", (name,)).rowcount))


def _names(db: SqliteDatabase) -> list[str]:
    return asyncio.run(db.call(
        lambda c: [row[0] for row in c.execute("SELECT name FROM items ORDER BY name")]))


def test_first_call_creates_the_file_in_wal_mode_with_the_schema(tmp_path: Path) -> None:
    db = _db(tmp_path / "nested" / "items.db")
    assert _insert(db, "a") == 1
    assert asyncio.run(db.call(lambda c: c.execute("PRAGMA journal_mode").fetchone()[0])) == "wal"
    indexes = asyncio.run(db.call(lambda c: c.execute(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'items' "
        "AND name NOT LIKE 'sqlite_%'").fetchall()))
    assert indexes == [("items_by_name",)]
    db.close()


def test_an_sqlite_error_is_raised_as_the_backend_error_naming_the_file(tmp_path: Path) -> None:
    db = _db(tmp_path / "items.db")
    with pytest.raises(ItemsError) as info:
        asyncio.run(db.call(lambda c: c.execute("SELECT * FROM missing")))
    assert str(info.value) == f"sqlite items {tmp_path / 'items.db'}: no such table: missing"
    assert isinstance(info.value.__cause__, sqlite3.OperationalError)
    _insert(db, "a")
    with pytest.raises(ItemsError, match="UNIQUE constraint failed: items.name"):
        _insert(db, "a")
    db.close()


def test_other_exceptions_pass_through_unwrapped(tmp_path: Path) -> None:
    def work(conn: sqlite3.Connection) -> None:
        raise KeyError("mine")

    db = _db(tmp_path / "items.db")
    with pytest.raises(KeyError):
        asyncio.run(db.call(work))
    db.close()


def test_opening_while_another_connection_holds_the_write_lock_waits(tmp_path: Path) -> None:
    # The WAL switch answers "database is locked" at once here, without the busy handler: the
    # set-up is retried until the other writer commits.
    path = tmp_path / "items.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE items (name TEXT PRIMARY KEY)")
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO items VALUES ('held')")
    timer = threading.Timer(0.2, lambda: holder.execute("COMMIT"))
    timer.start()
    db = _db(path)
    try:
        assert _insert(db, "mine") == 1
        assert _names(db) == ["held", "mine"]
    finally:
        timer.join()
        holder.close()
        db.close()


def _insert_at_once(dbs: list[SqliteDatabase]) -> list[BaseException]:
    """Each db (a fresh connection) inserts one row, all released at the same moment."""
    start = threading.Barrier(len(dbs))
    failures: list[BaseException] = []

    def open_and_insert(db: SqliteDatabase, name: str) -> None:
        start.wait()
        try:
            _insert(db, name)
        except BaseException as exc:  # reported by the caller, with the others
            failures.append(exc)

    threads = [threading.Thread(target=open_and_insert, args=(db, f"n{i}"))
               for i, db in enumerate(dbs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def test_many_processes_opening_one_new_file_at_once_all_succeed(tmp_path: Path) -> None:
    for attempt in range(5):
        dbs = [_db(tmp_path / f"items-{attempt}.db") for _ in range(4)]
        assert _insert_at_once(dbs) == []
        assert _names(dbs[0]) == ["n0", "n1", "n2", "n3"]
        for db in dbs:
            db.close()


def test_close_then_call_reopens_the_connection(tmp_path: Path) -> None:
    db = _db(tmp_path / "items.db")
    _insert(db, "a")
    asyncio.run(db.aclose())
    asyncio.run(db.aclose())  # closing twice is fine
    assert _names(db) == ["a"]
    db.close()


def test_sqlite_urls_need_an_absolute_path_for_every_store() -> None:
    from strata.state.pins import create_pin_store
    from strata.state.sessions import create_session_store

    assert sqlite_path("sqlite:///var/x.db", what="w", example="e") == "/var/x.db"
    for url in ("sqlite://x.db", "sqlite:///", "sqlite://"):
        with pytest.raises(ConfigError, match=f"sqlite w URL '{url}' needs an absolute path, "
                                              "e.g. sqlite:///e.db"):
            sqlite_path(url, what="w", example="sqlite:///e.db")
    with pytest.raises(ConfigError, match="sqlite pin store URL 'sqlite://p.db' needs an abs"):
        create_pin_store("sqlite://p.db")
    with pytest.raises(ConfigError, match="sqlite session store URL 'sqlite://s.db' needs"):
        create_session_store("sqlite://s.db")
