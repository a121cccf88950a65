"""The session store: conversation history outside the instances (contract: base.py).

    create_session_store("memory://")                 one process (memory.py)
    create_session_store("sqlite:///abs/path.db")     one machine, many processes (sqlite.py)
    create_session_store("redis://127.0.0.1:6379/0")  many machines (redis.py)

Any of them at the `session` or `eventual` level: acknowledged from memory, written behind
(write_behind.py).
"""

from __future__ import annotations

import time

from strata.errors import SessionConflictError, SessionNotFoundError, SessionStoreUnavailableError
from strata.state.sessions.base import (
    APPENDFSYNC,
    CONSISTENCY_LEVELS,
    Clock,
    Message,
    SessionRecord,
    SessionStore,
    SessionStoreOptions,
    cas_failure,
    check_append,
)
from strata.state.sessions.write_behind import WriteBehindSessionStore, WriteBehindStats
from strata.state.urls import backend_module


def create_session_store(url: str, *, clock: Clock = time.time,
                         redis_appendfsync: str | None = None, redis_replicas: int = 0,
                         consistency: str = "strong", flush_bound_s: float = 0.2,
                         max_pending: int = 1024) -> SessionStore:
    """The backend named by `url`'s scheme (strata/state/urls.py), written behind at the
    `session` and `eventual` levels; the options are SessionStoreOptions'."""
    options = SessionStoreOptions(clock=clock, redis_appendfsync=redis_appendfsync,
                                  redis_replicas=redis_replicas, consistency=consistency,
                                  flush_bound_s=flush_bound_s, max_pending=max_pending)
    store: SessionStore = backend_module("sessions", url).from_url(url, options)
    if consistency == "strong":
        return store
    return WriteBehindSessionStore(
        store, max_pending=max_pending,
        bound_s=flush_bound_s if consistency == "session" else None)


__all__ = [
    "APPENDFSYNC",
    "CONSISTENCY_LEVELS",
    "Message",
    "SessionConflictError",
    "SessionNotFoundError",
    "SessionRecord",
    "SessionStore",
    "SessionStoreOptions",
    "SessionStoreUnavailableError",
    "WriteBehindSessionStore",
    "WriteBehindStats",
    "cas_failure",
    "check_append",
    "create_session_store",
]
