"""Shared state behind small async interfaces: memory, SQLite and Redis backends.

    sessions.py        SessionStore: conversation history with compare-and-set appends
    pins.py            PinStore: session -> instance (sticky routing) and session -> version pins
    kv_store.py        KVStore: KV blocks by block hash (KV offload), memory and Redis
    response_cache.py  ResponseCache: finished answers of deterministic requests, by versioned key
"""

from __future__ import annotations

from strata.state.sessions import (
    SessionConflictError,
    SessionNotFoundError,
    SessionRecord,
    SessionStore,
    SessionStoreUnavailableError,
    create_session_store,
)

__all__ = [
    "SessionConflictError",
    "SessionNotFoundError",
    "SessionRecord",
    "SessionStore",
    "SessionStoreUnavailableError",
    "create_session_store",
]
