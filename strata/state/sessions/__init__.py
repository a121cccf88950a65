"""The session store: conversation history outside the instances (contract: base.py).

    create_session_store("memory://")                 one process (memory.py)
    create_session_store("sqlite:///abs/path.db")     one machine, many processes (sqlite.py)
    create_session_store("redis://127.0.0.1:6379/0")  many machines (redis.py)
"""

from __future__ import annotations

import time

from strata.errors import SessionConflictError, SessionNotFoundError, SessionStoreUnavailableError
from strata.state.sessions.base import (
    APPENDFSYNC,
    Clock,
    Message,
    SessionRecord,
    SessionStore,
    SessionStoreOptions,
    cas_failure,
    check_append,
)
from strata.state.urls import backend_module


def create_session_store(url: str, *, clock: Clock = time.time,
                         redis_appendfsync: str | None = None,
                         redis_replicas: int = 0) -> SessionStore:
    """The backend named by `url`'s scheme (strata/state/urls.py); the options are
    SessionStoreOptions'."""
    options = SessionStoreOptions(clock=clock, redis_appendfsync=redis_appendfsync,
                                  redis_replicas=redis_replicas)
    store: SessionStore = backend_module("sessions", url).from_url(url, options)
    return store


__all__ = [
    "APPENDFSYNC",
    "Message",
    "SessionConflictError",
    "SessionNotFoundError",
    "SessionRecord",
    "SessionStore",
    "SessionStoreOptions",
    "SessionStoreUnavailableError",
    "cas_failure",
    "check_append",
    "create_session_store",
]
