"""The session store: conversation history outside the instances, one source of truth.

A session is keyed by (tenant, session id): the tenant is the hashed API key that created it, so
two tenants that pick the same id get two independent sessions and neither can read, extend,
list or delete the other's (`get` answers None, `delete` False).

Every change is one `append` guarded by a revision number (optimistic concurrency):

    revision 0         the session does not exist (never created, deleted or expired)
    append(expected_revision=r)  stores the messages and returns revision r + 1, atomically,
                       only if the current revision is r; else SessionConflictError
                       (r = 0 against a live session is a conflict too)

`ttl_s` is sliding: each append sets the expiry to `ttl_s` after it (None: never expires). An
expired session reads as absent. Values are JSON everywhere (never pickle).

    StrataError
    ├── SessionConflictError          the revision moved on (another turn was stored first)
    ├── SessionNotFoundError          no such session for this tenant (unknown, expired, deleted)
    └── SessionStoreUnavailableError  the backend cannot be reached (Redis down, disk error)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from strata.clock import Clock
from strata.errors import (
    ConfigError,
    SessionConflictError,
    SessionNotFoundError,
    SessionStoreUnavailableError,
    StrataError,
)

Message = dict[str, Any]

@dataclass(frozen=True, slots=True)
class SessionRecord:
    """One session as stored. `messages` are OpenAI chat messages (role, content, name?)."""

    session_id: str
    tenant: str
    messages: tuple[Message, ...]
    revision: int
    model: str
    version: str
    created_at: float
    updated_at: float

    def to_json(self) -> dict[str, Any]:
        return {"id": self.session_id, "tenant": self.tenant, "messages": list(self.messages),
                "revision": self.revision, "model": self.model, "version": self.version,
                "created_at": self.created_at, "updated_at": self.updated_at}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SessionRecord:
        return cls(session_id=str(data["id"]), tenant=str(data["tenant"]),
                   messages=tuple(dict(m) for m in data["messages"]),
                   revision=int(data["revision"]), model=str(data["model"]),
                   version=str(data["version"]), created_at=float(data["created_at"]),
                   updated_at=float(data["updated_at"]))


class SessionStore(Protocol):
    """Async session history store; memory, SQLite (WAL) and Redis (Lua CAS) pass one contract."""

    async def get(self, session_id: str, *, tenant: str) -> SessionRecord | None:
        """The live session, or None (unknown, expired, or another tenant's)."""
        ...

    async def append(self, session_id: str, *, tenant: str, expected_revision: int,
                     messages: Sequence[Message], model: str, version: str,
                     ttl_s: float | None) -> SessionRecord:
        """Compare-and-set: add `messages` if the revision is `expected_revision` (0 creates).

        Raises SessionConflictError when the revision differs, SessionNotFoundError when
        `expected_revision` > 0 and the session no longer exists."""
        ...

    async def delete(self, session_id: str, *, tenant: str) -> bool:
        """True when this tenant's live session was removed."""
        ...

    async def list(self, *, tenant: str | None = None, limit: int = 100) -> list[SessionRecord]:
        """Live sessions (of `tenant`, or of everyone), most recently updated first."""
        ...

    async def close(self) -> None:
        """Release connections; the store is unusable afterwards."""
        ...


def check_append(session_id: str, tenant: str, expected_revision: int,
                 ttl_s: float | None) -> None:
    """Argument checks shared by every backend."""
    if not session_id or not tenant:
        raise ConfigError("session_id and tenant must be non-empty strings")
    if expected_revision < 0:
        raise ConfigError(f"expected_revision must be >= 0, got {expected_revision}")
    if ttl_s is not None and ttl_s <= 0:
        raise ConfigError(f"ttl_s must be positive or None (no expiry), got {ttl_s}")


def cas_failure(session_id: str, expected_revision: int, actual_revision: int) -> StrataError:
    """The error of a failed compare-and-set: not found (the session vanished) or conflict."""
    if actual_revision == 0 and expected_revision > 0:
        return SessionNotFoundError(session_id)
    return SessionConflictError(session_id, expected_revision=expected_revision,
                                actual_revision=actual_revision)


APPENDFSYNC = ("always", "everysec", "no")
CONSISTENCY_LEVELS = ("strong", "session", "eventual")  # write_behind.py draws the three


@dataclass(frozen=True, slots=True)
class SessionStoreOptions:
    """What `create_session_store` hands every backend's `from_url`.

    `redis_appendfsync` ("always", "everysec", "no"): the Redis store turns on Redis' append-only
    file with that fsync policy (CONFIG SET) before its first command; with None the server's own
    settings stand (start it with `--appendonly yes --appendfsync always` for zero loss).
    `redis_replicas`: a stored turn is acknowledged only once that many replicas hold it (Redis'
    WAIT, up to `redis_replica_timeout_s`; fewer is the store's unavailable error), so a
    failover to a replica loses no acknowledged turn.
    `consistency`: "strong" writes each turn to the store before it is acknowledged; "session"
    and "eventual" acknowledge from memory and write behind (write_behind.py), at most
    `max_pending` turns queued and, at "session", none older than `flush_bound_s`."""

    clock: Clock = time.time
    redis_appendfsync: str | None = None
    redis_replicas: int = 0
    redis_replica_timeout_s: float = 2.0
    consistency: str = "strong"
    flush_bound_s: float = 0.2
    max_pending: int = 1024

    def __post_init__(self) -> None:
        if self.redis_appendfsync is not None and self.redis_appendfsync not in APPENDFSYNC:
            raise ConfigError(f"redis_appendfsync must be one of {', '.join(APPENDFSYNC)}, "
                              f"got {self.redis_appendfsync!r}")
        if self.redis_replicas < 0 or self.redis_replica_timeout_s <= 0:
            raise ConfigError("redis_replicas must be >= 0 and redis_replica_timeout_s > 0, "
                              f"got {self.redis_replicas} and {self.redis_replica_timeout_s}")
        if self.consistency not in CONSISTENCY_LEVELS:
            raise ConfigError(f"session consistency must be one of "
                              f"{', '.join(CONSISTENCY_LEVELS)}, got {self.consistency!r}")
        if self.flush_bound_s <= 0 or self.max_pending < 1:
            raise ConfigError("the session flush bound must be > 0 s and the write-behind queue "
                              f"hold >= 1 turn, got {self.flush_bound_s} and {self.max_pending}")


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
    "cas_failure",
    "check_append",
]
