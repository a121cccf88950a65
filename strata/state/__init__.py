"""Shared state behind small async interfaces: memory, SQLite and Redis backends.

One package per store, each laid out alike: `base.py` (the Protocol, its records and errors,
the contract in the docstring), one module per backend (`memory.py`, `sqlite.py`, `redis.py`,
each with `from_url(url, options)`) and the factory in `__init__.py`, which imports a backend
only when a URL names it:

    sessions/        SessionStore: conversation history with compare-and-set appends
    pins/            PinStore: session -> instance (sticky routing) and session -> version pins
    kv_store/        KVStore: KV blocks by block hash (KV offload), memory and Redis
    response_cache/  ResponseCache: finished answers of deterministic requests, by versioned key
    usage/           UsageStore: tenants' token and request counts, and their budget windows

    urls.py          the URL schemes of every store (and the registry's): factories and --help
    sqlite_db.py     the SQLite connection every SQLite backend uses (WAL, busy timeout, errors)
    redis_db.py      the Redis client every Redis backend uses (error mapping, one-time set-up)
"""

from __future__ import annotations

from strata.errors import SessionConflictError, SessionNotFoundError, SessionStoreUnavailableError
from strata.state.sessions import SessionRecord, SessionStore, create_session_store

__all__ = [
    "SessionConflictError",
    "SessionNotFoundError",
    "SessionRecord",
    "SessionStore",
    "SessionStoreUnavailableError",
    "create_session_store",
]
