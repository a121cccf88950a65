"""Write-behind session history: the `session` and `eventual` levels (docs/consistency.md).

    strong    every turn is a compare-and-set on the store before it is acknowledged (no
              wrapper: the backend itself, with its fsync and WAIT settings)
    session   the turn is acknowledged from this instance's memory and written to the store by
              one background flusher, in order; this instance reads its own writes (the pinned
              instance of a session). A turn is refused (SessionStoreUnavailableError, 503)
              while the queue is full, its oldest turn is older than `bound_s`, or writing
              it all would take longer (its length x the mean write): a turn is acknowledged
              only when it is expected in the store within `bound_s`, so a crash loses about
              the turns of the last `bound_s` (the lag is on /metrics)
    eventual  as `session` without the age bound: only the queue's length bounds what a
              crash loses and how stale another instance's read is

The flusher writes each queued turn with the compare-and-set it was accepted under, so the
store's history is the instance's, turn for turn. A turn the store refuses (another instance
wrote the session meanwhile: the pin moved) is lost, counted in `num_lost` with the session's
later queued turns, and this instance reads the store's history again. A store that cannot be
reached keeps the queue (retried every `retry_s`): turns queue until the bound refuses them,
never dropped. `close` flushes the queue (a drain loses nothing while the store answers)
before it closes the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from strata.errors import (
    SessionConflictError,
    SessionNotFoundError,
    SessionStoreUnavailableError,
)
from strata.state.sessions.base import (
    Clock,
    Message,
    SessionRecord,
    SessionStore,
    cas_failure,
    check_append,
)

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (tenant, session id)


@dataclass(slots=True)
class _Write:
    """One acknowledged turn waiting for the store."""

    key: Key
    expected_revision: int
    messages: tuple[Message, ...]
    model: str
    version: str
    ttl_s: float | None
    enqueued_at: float
    num_messages: int  # the session's length once this turn is in
    is_cancelled: bool = False  # deleted, or lost with an earlier turn of its session
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True, slots=True)
class WriteBehindStats:
    """What /metrics reports (strata:session_write_*): the queue, its lag and its outcomes."""

    level: str
    num_pending: int
    lag_s: float  # age of the oldest unwritten turn; 0 with none
    num_flushed: int
    num_lost: int  # refused by the store (another writer), or unwritten at close
    num_refused: int  # turns refused with a 503: queue full or lag past the bound
    max_pending: int
    bound_s: float | None


class WriteBehindSessionStore:
    """A SessionStore that acknowledges from memory and writes `backend` behind."""

    def __init__(self, backend: SessionStore, *, max_pending: int = 1024,
                 bound_s: float | None = 0.2, clock: Clock = time.monotonic,
                 wall_clock: Clock = time.time, retry_s: float = 0.05,
                 write_timeout_s: float = 2.0, close_timeout_s: float = 10.0) -> None:
        self.backend = backend
        self.max_pending = max_pending
        self.bound_s = bound_s
        self.clock, self.wall_clock = clock, wall_clock
        # a write that hangs (a connection to a store that died mid-reply) is abandoned and
        # retried: the retry finds it stored if it landed (_has_landed)
        self.retry_s, self.write_timeout_s = retry_s, write_timeout_s
        self.close_timeout_s = close_timeout_s
        self._pending: deque[_Write] = deque()
        self._latest: dict[Key, SessionRecord] = {}  # this instance's view while it has writes
        self._num_pending_of: dict[Key, int] = {}
        self._num_pending = 0
        self._counts = {"flushed": 0, "lost": 0, "refused": 0}
        self._wakeup = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._in_flight: _Write | None = None  # at the queue's front until it settles
        self._write_s = 0.0  # moving mean of one write (the drain time: x the queue length)

    @property
    def level(self) -> str:
        return "eventual" if self.bound_s is None else "session"

    def stats(self) -> WriteBehindStats:
        c = self._counts
        return WriteBehindStats(self.level, self._num_pending, self.lag_s(), c["flushed"],
                                c["lost"], c["refused"], self.max_pending, self.bound_s)

    def lag_s(self) -> float:
        head = self._head()
        return 0.0 if head is None else max(0.0, self.clock() - head.enqueued_at)

    def admit(self) -> None:
        """Refuse a new turn (503) while the queue is full or, at `session`, while its oldest
        turn or the time to write it all (its length x the mean write) passes the bound; the
        instance calls it before generating, so a refused turn costs no generation."""
        if self._num_pending >= self.max_pending:
            self._refuse(f"{self._num_pending} turns wait to be written (the write-behind "
                         f"queue holds {self.max_pending})")
        if self.bound_s is None:
            return
        lag_s, drain_s = self.lag_s(), (self._num_pending + 1) * self._write_s
        if lag_s > self.bound_s:
            self._refuse(f"the oldest unwritten turn is {lag_s * 1000:.0f} ms old, past the "
                         f"session level's bound of {self.bound_s * 1000:.0f} ms")
        if drain_s > self.bound_s:
            self._refuse(f"{self._num_pending} unwritten turns and this one take "
                         f"{drain_s * 1000:.0f} ms to write, past the session level's bound of "
                         f"{self.bound_s * 1000:.0f} ms")

    # --- the SessionStore contract -----------------------------------------------------------

    async def get(self, session_id: str, *, tenant: str) -> SessionRecord | None:
        latest = self._latest.get((tenant, session_id))
        return latest if latest is not None else \
            await self.backend.get(session_id, tenant=tenant)

    async def append(self, session_id: str, *, tenant: str, expected_revision: int,
                     messages: Sequence[Message], model: str, version: str,
                     ttl_s: float | None) -> SessionRecord:
        check_append(session_id, tenant, expected_revision, ttl_s)
        self.admit()
        key = (tenant, session_id)
        current = self._latest.get(key)
        if current is None:
            stored = await self.backend.get(session_id, tenant=tenant)
            current = self._latest.get(key, stored)  # a turn of ours may have landed meanwhile
        actual = current.revision if current is not None else 0
        if actual != expected_revision:
            raise cas_failure(session_id, expected_revision, actual)
        added = tuple(json.loads(json.dumps(list(messages))))  # never aliases the caller's
        record = self._extended(current, key, added, model, version)
        self._enqueue(_Write(key, expected_revision, added, model, version, ttl_s, self.clock(),
                             len(record.messages)), record)
        return record

    async def delete(self, session_id: str, *, tenant: str) -> bool:
        key = (tenant, session_id)
        writes = [w for w in self._pending if w.key == key and not w.is_cancelled]
        for write in writes:
            self._cancel(write)
        in_flight = self._in_flight
        if in_flight is not None and in_flight.key == key:  # let it land, then delete it
            await in_flight.done.wait()
        return await self.backend.delete(session_id, tenant=tenant) or bool(writes)

    async def list(self, *, tenant: str | None = None, limit: int = 100) -> list[SessionRecord]:
        stored = {(r.tenant, r.session_id): r for r in await self.backend.list(
            tenant=tenant, limit=limit + len(self._latest))}
        stored.update({k: r for k, r in self._latest.items() if tenant in (None, k[0])})
        live = sorted(stored.values(), key=lambda r: (-r.updated_at, r.session_id))
        return live[:limit]

    async def close(self) -> None:
        """Flush what is queued (up to `close_timeout_s`), then close the store."""
        try:
            await asyncio.wait_for(self.flush(), self.close_timeout_s)
        except TimeoutError:
            log.error("session store closed with %d acknowledged turns unwritten (lost)",
                      self._num_pending)
            self._counts["lost"] += self._num_pending
        if self._flusher is not None:
            self._flusher.cancel()
        await self.backend.close()

    async def flush(self) -> None:
        """Return once every turn queued before the call is written (or lost)."""
        if self._head() is not None:
            last = self._pending[-1]
            self._start()
            await last.done.wait()

    # --- the flusher -------------------------------------------------------------------------

    def _enqueue(self, write: _Write, record: SessionRecord) -> None:
        self._latest[write.key] = record
        self._pending.append(write)
        self._num_pending += 1
        self._num_pending_of[write.key] = self._num_pending_of.get(write.key, 0) + 1
        self._start()
        self._wakeup.set()

    def _start(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            head = self._head()
            if head is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._in_flight, start_s = head, self.clock()
            try:
                is_settled = await asyncio.wait_for(self._write(head), self.write_timeout_s)
                took_s = self.clock() - start_s
                self._write_s = took_s if not self._write_s else \
                    self._write_s + 0.2 * (took_s - self._write_s)
            except TimeoutError:
                log.warning("session store: silent for %g s on a queued turn; retrying",
                            self.write_timeout_s)
                is_settled = False
            finally:
                self._in_flight = None
            if is_settled:
                self._pending.popleft()  # the head stays at the front while in flight
                self._settle(head)
            else:
                await asyncio.sleep(self.retry_s)

    async def _write(self, write: _Write) -> bool:
        """Store one turn: True once it is settled (stored or lost), False to retry."""
        tenant, session_id = write.key
        try:
            await self.backend.append(
                session_id, tenant=tenant, expected_revision=write.expected_revision,
                messages=write.messages, model=write.model, version=write.version,
                ttl_s=write.ttl_s)
        except (SessionConflictError, SessionNotFoundError) as exc:
            if await self._has_landed(write):  # an earlier try stored it; its reply was lost
                self._counts["flushed"] += 0 if write.is_cancelled else 1
                return True
            if not write.is_cancelled:
                log.warning("session %s: an acknowledged turn was not written: %s", session_id,
                            exc)
                self._lose(write.key)
            return True
        except SessionStoreUnavailableError:
            return False
        except Exception:  # the flusher must outlive any one failure: keep the turn, retry
            log.exception("session store: writing a queued turn failed; retrying")
            return False
        if not write.is_cancelled:
            self._counts["flushed"] += 1
        return True

    async def _has_landed(self, write: _Write) -> bool:
        """Whether the store holds `write` at its revision: a try whose connection broke after
        the store ran it is retried, and that retry's compare-and-set fails on the turn itself."""
        try:
            record = await self.backend.get(write.key[1], tenant=write.key[0])
        except SessionStoreUnavailableError:
            return False
        if record is None or record.revision <= write.expected_revision:
            return False
        start = write.num_messages - len(write.messages)
        return record.messages[start:write.num_messages] == write.messages

    def _head(self) -> _Write | None:
        """The oldest write not cancelled (cancelled ones are dropped from the front)."""
        while self._pending and self._pending[0].is_cancelled \
                and self._pending[0] is not self._in_flight:
            self._pending.popleft().done.set()
        return self._pending[0] if self._pending else None

    def _lose(self, key: Key) -> None:
        """The store refused a turn of `key`: it and the session's later turns are lost."""
        for write in [w for w in self._pending if w.key == key and not w.is_cancelled]:
            self._counts["lost"] += 1
            self._cancel(write)

    def _cancel(self, write: _Write) -> None:
        write.is_cancelled = True
        self._forget(write)

    def _settle(self, write: _Write) -> None:
        if not write.is_cancelled:
            self._forget(write)
        write.done.set()

    def _forget(self, write: _Write) -> None:
        """One fewer pending write; the session's local view goes with its last one."""
        self._num_pending -= 1
        left = self._num_pending_of[write.key] - 1
        if left:
            self._num_pending_of[write.key] = left
        else:
            del self._num_pending_of[write.key]
            self._latest.pop(write.key, None)

    def _extended(self, current: SessionRecord | None, key: Key,
                  messages: tuple[Message, ...], model: str, version: str) -> SessionRecord:
        now = self.wall_clock()
        if current is None:
            return SessionRecord(key[1], key[0], messages, 1, model, version, now, now)
        return replace(current, messages=current.messages + messages,
                       revision=current.revision + 1, model=model, version=version,
                       updated_at=now)

    def _refuse(self, why: str) -> None:
        self._counts["refused"] += 1
        raise SessionStoreUnavailableError(f"session store: {why}; retry the turn shortly")


__all__ = ["WriteBehindSessionStore", "WriteBehindStats"]
