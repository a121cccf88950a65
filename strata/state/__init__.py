"""Shared state behind small async interfaces: memory, SQLite and Redis backends.

    sessions.py   SessionStore: conversation history with compare-and-set appends
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
