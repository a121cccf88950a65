"""The in-process session store (one process; tests and `strata serve` without a shared store).

Each method runs without awaiting, so on one event loop every append is atomic by construction.
Messages are copied through JSON on the way in, so a stored session never aliases caller data and
holds only what the other backends could hold.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from strata.state.sessions.base import (
    Clock,
    Message,
    SessionRecord,
    SessionStoreOptions,
    cas_failure,
    check_append,
)


@dataclass(frozen=True, slots=True)
class _Entry:
    record: SessionRecord
    expires_at: float | None


class MemorySessionStore:
    """A SessionStore in a dict keyed by (tenant, session id)."""

    def __init__(self, *, clock: Clock = time.time) -> None:
        self.clock = clock
        self._entries: dict[tuple[str, str], _Entry] = {}

    async def get(self, session_id: str, *, tenant: str) -> SessionRecord | None:
        entry = self._live((tenant, session_id))
        return entry.record if entry is not None else None

    async def append(self, session_id: str, *, tenant: str, expected_revision: int,
                     messages: Sequence[Message], model: str, version: str,
                     ttl_s: float | None) -> SessionRecord:
        check_append(session_id, tenant, expected_revision, ttl_s)
        key = (tenant, session_id)
        entry = self._live(key)
        actual = entry.record.revision if entry is not None else 0
        if actual != expected_revision:
            raise cas_failure(session_id, expected_revision, actual)
        now = self.clock()
        added = tuple(json.loads(json.dumps(list(messages))))
        if entry is None:
            record = SessionRecord(session_id, tenant, added, 1, model, version, now, now)
        else:
            record = replace(entry.record, messages=entry.record.messages + added,
                             revision=actual + 1, model=model, version=version, updated_at=now)
        self._entries[key] = _Entry(record, None if ttl_s is None else now + ttl_s)
        return record

    async def delete(self, session_id: str, *, tenant: str) -> bool:
        key = (tenant, session_id)
        found = self._live(key) is not None
        self._entries.pop(key, None)
        return found

    async def list(self, *, tenant: str | None = None, limit: int = 100) -> list[SessionRecord]:
        live = [e.record for k, e in list(self._entries.items())
                if (tenant is None or k[0] == tenant) and self._live(k) is not None]
        live.sort(key=lambda r: (-r.updated_at, r.session_id))
        return live[:limit]

    async def close(self) -> None:
        self._entries.clear()

    def _live(self, key: tuple[str, str]) -> _Entry | None:
        """The entry unless it expired (an expired one is dropped on sight)."""
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at is not None and entry.expires_at <= self.clock():
            del self._entries[key]
            return None
        return entry


def from_url(url: str, options: SessionStoreOptions) -> MemorySessionStore:
    return MemorySessionStore(clock=options.clock)


__all__ = ["MemorySessionStore", "from_url"]
