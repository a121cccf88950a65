"""A Jepsen-style history of session turns, and the check of each consistency level.

Writers (fixed seeds) run turns as an instance does (strata/server/sessions.py): under a lock
per (instance, session), read the session, then append one message with the revision read.
"Instances" are session stores of their own over one Redis (each holds its own connections and,
written behind, its own queue). Every operation is recorded with its start, its end and what it
acknowledged or saw; the checks read only the history and the store's final state:

    lost_turns           strong (and any level without an instance crash): every acknowledged
                         turn is in the final history at its revision
    read_your_writes     session: a read on the instance that acknowledged a turn, begun after
                         the acknowledgement, sees it
    staleness            eventual: what a read on another instance misses, in turns and seconds

Faults, each verified as applied:

    RedisKill        the store SIGKILLed and restarted: another process serves after, and
                     operations failed between the two
    StorePartition   one instance cut from the store (a loopback proxy between them resets every
                     connection, open or new) while the others reach it: operations failed on
                     the cut instance and others were acknowledged elsewhere meanwhile
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from harness.redis_server import RedisServer, serving_pid
from harness.tcp_proxy import ChaosProxy
from strata.errors import StrataError
from strata.state.sessions import SessionStore

TENANT = "jepsen"


@dataclass(frozen=True, slots=True)
class Op:
    kind: str  # "append" or "read"
    session: str
    instance: int
    start_s: float
    end_s: float
    revision: int  # append: the revision acknowledged; read: the revision seen (0: none)
    marker: str = ""  # append: the message it stored
    error: str = ""  # the error's class name; "" when acknowledged or answered

    @property
    def is_ok(self) -> bool:
        return not self.error


@dataclass(slots=True)
class History:
    ops: list[Op] = field(default_factory=list)

    def acked(self, kind: str = "append") -> list[Op]:
        return [op for op in self.ops if op.kind == kind and op.is_ok]

    def num_failed_between(self, start_s: float, end_s: float, *,
                           instance: int | None = None) -> int:
        return sum(1 for op in self.ops
                   if op.error and op.error != "SessionConflictError"
                   and start_s <= op.start_s <= end_s
                   and (instance is None or op.instance == instance))

    def num_acked_between(self, start_s: float, end_s: float, *, instance: int) -> int:
        return sum(1 for op in self.ops
                   if op.is_ok and op.instance == instance and start_s <= op.start_s
                   and op.end_s <= end_s)

    async def read(self, store: SessionStore, instance: int, session: str) -> Op:
        start_s = time.monotonic()
        try:
            record = await store.get(session, tenant=TENANT)
        except StrataError as exc:
            return self._add(Op("read", session, instance, start_s, time.monotonic(), -1,
                                error=type(exc).__name__))
        return self._add(Op("read", session, instance, start_s, time.monotonic(),
                            0 if record is None else record.revision))

    async def append(self, store: SessionStore, instance: int, session: str, revision: int,
                     marker: str) -> Op:
        start_s = time.monotonic()
        try:
            record = await store.append(session, tenant=TENANT, expected_revision=revision,
                                        messages=[{"role": "user", "content": marker}],
                                        model="m", version="v1", ttl_s=None)
        except StrataError as exc:
            return self._add(Op("append", session, instance, start_s, time.monotonic(), -1,
                                marker, type(exc).__name__))
        return self._add(Op("append", session, instance, start_s, time.monotonic(),
                            record.revision, marker))

    def _add(self, op: Op) -> Op:
        self.ops.append(op)
        return op


@dataclass(frozen=True, slots=True)
class Workload:
    """Who writes what. `is_pinned`: a session's turns all go to one instance (the gateway's
    pin); else each turn picks an instance, so instances race on shared sessions."""

    num_sessions: int = 6
    num_writers: int = 8
    seed: int = 33
    is_pinned: bool = True
    cross_reads: bool = False  # after each turn, read the session on another instance too


async def run_writers(stores: Sequence[SessionStore], history: History, workload: Workload,
                      stop: asyncio.Event) -> None:
    sessions = [f"s{i}" for i in range(workload.num_sessions)]
    locks = {(i, s): asyncio.Lock() for i in range(len(stores)) for s in sessions}

    async def writer(w: int) -> None:
        rng = random.Random(workload.seed * 1000 + w)
        for n in range(1_000_000):
            if stop.is_set():
                return
            session = rng.choice(sessions)
            instance = sessions.index(session) % len(stores) if workload.is_pinned \
                else rng.randrange(len(stores))
            async with locks[(instance, session)]:
                op = await turn(stores[instance], history, instance, session, f"w{w}-{n}")
            if workload.cross_reads:
                other = (instance + 1) % len(stores)
                await history.read(stores[other], other, session)
            if op.error and op.error != "SessionConflictError":
                await asyncio.sleep(0.01)  # the store is down: do not spin

    await asyncio.gather(*(writer(w) for w in range(workload.num_writers)))


async def turn(store: SessionStore, history: History, instance: int, session: str,
               marker: str) -> Op:
    """One turn: read, append with the revision read, read back on the same instance."""
    read = await history.read(store, instance, session)
    if not read.is_ok:
        return read
    op = await history.append(store, instance, session, read.revision, marker)
    if op.is_ok:
        await history.read(store, instance, session)
    return op


# --- checks --------------------------------------------------------------------------------


async def final_histories(store: SessionStore, sessions: Sequence[str]) -> dict[str, list[str]]:
    records = {s: await store.get(s, tenant=TENANT) for s in sessions}
    return {s: [m["content"] for m in r.messages] if r else [] for s, r in records.items()}


def lost_turns(history: History, final: Mapping[str, Sequence[str]]) -> list[Op]:
    """Acknowledged appends that are not in the final history at their revision."""
    return [op for op in history.acked()
            if list(final.get(op.session, []))[op.revision - 1:op.revision] != [op.marker]]


def read_your_writes_violations(history: History) -> list[tuple[Op, Op]]:
    """(append, read) pairs: a read on the acknowledging instance, begun after the
    acknowledgement, that saw an older revision."""
    acked = history.acked()
    return [(a, r) for r in history.acked("read") for a in acked
            if a.session == r.session and a.instance == r.instance
            and a.end_s <= r.start_s and r.revision < a.revision]


@dataclass(frozen=True, slots=True)
class Staleness:
    num_reads: int
    num_stale_reads: int
    max_missed_turns: int
    max_stale_s: float


def staleness(history: History) -> Staleness:
    """What reads on another instance than the acknowledging one missed."""
    acked = history.acked()
    num_reads, stale, max_missed, max_s = 0, 0, 0, 0.0
    for r in history.acked("read"):
        elsewhere = [a for a in acked if a.session == r.session and a.instance != r.instance]
        if not elsewhere:
            continue
        num_reads += 1
        missed = [a for a in elsewhere if a.end_s <= r.start_s and a.revision > r.revision]
        if missed:
            stale += 1
            max_missed = max(max_missed, len(missed))
            max_s = max(max_s, r.start_s - min(a.end_s for a in missed))
    return Staleness(num_reads, stale, max_missed, max_s)


# --- the fault -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RedisKill:
    """A SIGKILL of the store and its restart, with the evidence that it happened."""

    killed_pid: int
    restarted_pid: int
    num_failed_ops: int  # operations that failed while it was down
    outage_s: float

    @property
    def is_applied(self) -> bool:
        return self.killed_pid != self.restarted_pid and self.num_failed_ops > 0


async def kill_redis(server: RedisServer, history: History, *, min_down_s: float = 0.2,
                     max_down_s: float = 3.0) -> RedisKill:
    """SIGKILL `server`, keep it down until an operation failed (at least `min_down_s`), then
    restart it on the same port and directory (it reloads its append-only file)."""
    killed_pid = serving_pid(server.port)
    assert killed_pid is not None, "invariant redis_serving: the store answers before the kill"
    start_s = time.monotonic()
    await asyncio.to_thread(server.stop, kill=True)
    await asyncio.sleep(min_down_s)
    while history.num_failed_between(start_s, time.monotonic()) == 0 \
            and time.monotonic() - start_s < max_down_s:
        await asyncio.sleep(0.02)
    await asyncio.to_thread(server.start)
    outage_s = time.monotonic() - start_s
    return RedisKill(killed_pid, serving_pid(server.port) or -1,
                     history.num_failed_between(start_s, start_s + outage_s), outage_s)


@dataclass(frozen=True, slots=True)
class StorePartition:
    """One instance cut from the store for a while, with the evidence that it happened."""

    instance: int
    num_resets: int  # connections the proxy reset (open ones, and new ones while cut)
    num_failed_ops: int  # operations that failed on the cut instance meanwhile
    num_acked_elsewhere: int  # operations acknowledged on the other instances meanwhile
    cut_s: float

    @property
    def is_applied(self) -> bool:
        return self.num_resets > 0 and self.num_failed_ops > 0 and self.num_acked_elsewhere > 0


async def partition_store(proxy: ChaosProxy, history: History, instance: int, num_instances: int,
                          *, min_cut_s: float = 0.3, max_cut_s: float = 6.0) -> StorePartition:
    """Cut `instance` (whose store connects through `proxy`) from the store until an operation
    of it failed and another instance acknowledged one meanwhile (at least `min_cut_s`), then
    heal: every connection reset, new ones too. Both are waited for: on a slow machine every
    writer can sit in the cut instance's retries until its first failure, so the other
    instance's acknowledgements come only after it."""
    start_s, resets_before = time.monotonic(), proxy.num_resets
    proxy.reset_probability = 1.0
    await asyncio.to_thread(proxy.reset_all)
    await asyncio.sleep(min_cut_s)

    def evidence(end_s: float) -> tuple[int, int]:
        failed = history.num_failed_between(start_s, end_s, instance=instance)
        elsewhere = sum(history.num_acked_between(start_s, end_s, instance=i)
                        for i in range(num_instances) if i != instance)
        return failed, elsewhere

    while 0 in evidence(time.monotonic()) and time.monotonic() - start_s < max_cut_s:
        await asyncio.sleep(0.02)
    proxy.reset_probability = 0.0
    end_s = time.monotonic()
    failed, elsewhere = evidence(end_s)
    return StorePartition(instance, proxy.num_resets - resets_before, failed, elsewhere,
                          end_s - start_s)


Fault = RedisKill | StorePartition


async def run_with_fault(stores: Sequence[SessionStore], workload: Workload,
                         fault: Callable[[History], Awaitable[Fault]], *, before_s: float,
                         after_s: float) -> tuple[History, Fault]:
    """Writers for `before_s`, the fault under them, writers for `after_s` more."""
    history, stop = History(), asyncio.Event()
    writers = asyncio.ensure_future(run_writers(stores, history, workload, stop))
    await asyncio.sleep(before_s)
    applied = await fault(history)
    await asyncio.sleep(after_s)
    stop.set()
    await writers
    return history, applied


__all__ = ["Fault", "History", "Op", "RedisKill", "Staleness", "StorePartition", "Workload",
           "final_histories", "kill_redis", "lost_turns", "partition_store",
           "read_your_writes_violations", "run_with_fault", "run_writers",
           "staleness"]
