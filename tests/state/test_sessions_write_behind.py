"""The write-behind session store (session/eventual levels) over an in-process store whose
availability and pace the story controls: acknowledged from memory, written in order, refused
(never dropped) when full or behind its bound, flushed on close."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import pytest

from strata.clock import ManualClock
from strata.errors import ConfigError, SessionConflictError, SessionStoreUnavailableError
from strata.protocol.openai import ChatCompletionRequest
from strata.server.config import ServerConfig
from strata.server.errors import map_exception
from strata.server.metrics import ServerMetrics
from strata.server.sessions import Sessions
from strata.state.sessions import (
    Message,
    SessionRecord,
    WriteBehindSessionStore,
    create_session_store,
)
from strata.state.sessions.memory import MemorySessionStore

T = "tenant"


class PacedStore(MemorySessionStore):
    """A memory store whose appends wait for `gate` and fail while `is_down`; `close` keeps
    the entries readable (`closed_with` records what was stored at close)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.is_down = False
        self.num_replies_to_lose = 0  # appends stored whose reply then fails
        self.closed_with: dict[str, int] | None = None

    async def append(self, session_id: str, *, tenant: str, expected_revision: int,
                     messages: Sequence[Message], model: str, version: str,
                     ttl_s: float | None) -> SessionRecord:
        await self.gate.wait()
        if self.is_down:
            raise SessionStoreUnavailableError("store down")
        record = await super().append(session_id, tenant=tenant,
                                      expected_revision=expected_revision, messages=messages,
                                      model=model, version=version, ttl_s=ttl_s)
        if self.num_replies_to_lose:
            self.num_replies_to_lose -= 1
            raise SessionStoreUnavailableError("connection lost after the write")
        return record

    async def close(self) -> None:
        self.closed_with = {r.session_id: r.revision for r in await self.list(limit=1000)}


def run(story: Callable[[PacedStore, WriteBehindSessionStore, ManualClock], Awaitable[None]],
        *, bound_s: float | None = 0.2, max_pending: int = 8) -> None:
    async def main() -> None:
        backend, clock = PacedStore(), ManualClock(100.0)
        store = WriteBehindSessionStore(backend, max_pending=max_pending, bound_s=bound_s,
                                        clock=clock, retry_s=0.001)
        await story(backend, store, clock)
        await store.close()

    asyncio.run(main())


async def turn(store: WriteBehindSessionStore | MemorySessionStore, sid: str, revision: int,
               text: str) -> SessionRecord:
    return await store.append(sid, tenant=T, expected_revision=revision,
                              messages=[{"role": "user", "content": text}], model="m",
                              version="v1", ttl_s=None)


def texts(record: SessionRecord | None) -> list[str]:
    return [] if record is None else [m["content"] for m in record.messages]


def test_acknowledged_from_memory_read_back_at_once_then_written_in_order() -> None:
    async def story(backend: PacedStore, store: WriteBehindSessionStore, _: ManualClock) -> None:
        backend.gate.clear()  # the store is slow: nothing lands yet
        for i in range(3):
            assert (await turn(store, "s", i, f"t{i}")).revision == i + 1
        assert texts(await store.get("s", tenant=T)) == ["t0", "t1", "t2"]  # read-your-writes
        assert await backend.get("s", tenant=T) is None
        assert (store.stats().num_pending, store.stats().num_flushed) == (3, 0)
        with pytest.raises(SessionConflictError):  # the CAS holds against the local view
            await turn(store, "s", 2, "stale")
        backend.gate.set()
        await store.flush()
        assert texts(await backend.get("s", tenant=T)) == ["t0", "t1", "t2"]
        assert (await backend.get("s", tenant=T)).revision == 3  # type: ignore[union-attr]
        stats = store.stats()
        assert (stats.num_pending, stats.num_flushed, stats.num_lost, stats.lag_s) == (0, 3, 0, 0)

    run(story)


def test_session_level_refuses_past_its_bound_and_loses_nothing_while_the_store_is_down() -> None:
    async def story(backend: PacedStore, store: WriteBehindSessionStore,
                    clock: ManualClock) -> None:
        backend.is_down = True
        await turn(store, "a", 0, "a0")
        await turn(store, "b", 0, "b0")
        clock.advance(0.15)
        assert store.lag_s() == pytest.approx(0.15)
        await turn(store, "a", 1, "a1")  # within the bound: taken
        clock.advance(0.1)  # the oldest unwritten turn is now 250 ms old, past 200 ms
        with pytest.raises(SessionStoreUnavailableError, match="250 ms old, past the session "
                           "level's bound of 200 ms"):
            store.admit()
        with pytest.raises(SessionStoreUnavailableError):
            await turn(store, "a", 2, "refused")
        assert (store.stats().num_pending, store.stats().num_refused) == (3, 2)
        backend.is_down = False
        await store.flush()
        assert texts(await backend.get("a", tenant=T)) == ["a0", "a1"]
        assert texts(await backend.get("b", tenant=T)) == ["b0"]
        store.admit()  # caught up: turns are taken again

    run(story)


def test_a_write_whose_reply_was_lost_is_found_stored_on_retry_not_lost() -> None:
    async def story(backend: PacedStore, store: WriteBehindSessionStore, _: ManualClock) -> None:
        backend.num_replies_to_lose = 1
        await turn(store, "r", 0, "r0")
        await turn(store, "r", 1, "r1")
        await store.flush()
        assert texts(await backend.get("r", tenant=T)) == ["r0", "r1"]
        assert (store.stats().num_flushed, store.stats().num_lost) == (2, 0)

    run(story)


def test_session_level_refuses_a_queue_that_would_take_longer_than_the_bound_to_write() -> None:
    async def story(backend: PacedStore, store: WriteBehindSessionStore,
                    clock: ManualClock) -> None:
        slow = backend.append

        async def append_taking_50_ms(*args: object, **kwargs: object) -> SessionRecord:
            clock.advance(0.05)
            return await slow(*args, **kwargs)  # type: ignore[arg-type]

        backend.append = append_taking_50_ms  # type: ignore[method-assign]
        await turn(store, "q", 0, "q0")
        await store.flush()  # one write measured: 50 ms
        backend.gate.clear()
        for i in range(4):  # 4 x 50 ms = the 200 ms bound: still taken
            await turn(store, f"q{i}", 0, "x")
        with pytest.raises(SessionStoreUnavailableError, match="4 unwritten turns and this one "
                           "take 250 ms to write, past the session level's bound of 200 ms"):
            await turn(store, "q9", 0, "x")
        backend.gate.set()

    run(story)


def test_eventual_level_has_no_age_bound_and_refuses_only_a_full_queue() -> None:
    async def story(backend: PacedStore, store: WriteBehindSessionStore,
                    clock: ManualClock) -> None:
        backend.is_down = True
        for i in range(4):
            await turn(store, "e", i, f"e{i}")
            clock.advance(60.0)
        assert store.stats().level == "eventual" and store.lag_s() == 240.0
        with pytest.raises(SessionStoreUnavailableError, match="4 turns wait to be written "
                           r"\(the write-behind queue holds 4\)"):
            await turn(store, "e", 4, "full")
        backend.is_down = False
        await store.flush()
        assert texts(await backend.get("e", tenant=T)) == ["e0", "e1", "e2", "e3"]

    run(story, bound_s=None, max_pending=4)


def test_a_turn_the_store_refuses_is_lost_with_its_sessions_later_turns_and_counted() -> None:
    async def story(backend: PacedStore, store: WriteBehindSessionStore, _: ManualClock) -> None:
        backend.gate.clear()
        await turn(store, "x", 0, "mine0")
        await turn(store, "x", 1, "mine1")
        await turn(store, "y", 0, "y0")
        await MemorySessionStore.append(backend, "x", tenant=T, expected_revision=0,
                                        messages=[{"role": "user", "content": "theirs"}],
                                        model="m", version="v1", ttl_s=None)  # another writer
        backend.gate.set()
        await store.flush()
        stats = store.stats()
        assert (stats.num_flushed, stats.num_lost, stats.num_pending) == (1, 2, 0)
        assert texts(await store.get("x", tenant=T)) == ["theirs"]  # the store's history again
        assert texts(await backend.get("y", tenant=T)) == ["y0"]

    run(story)


def test_close_flushes_every_acknowledged_turn_before_closing_the_store() -> None:
    async def main() -> None:
        backend = PacedStore()
        store = WriteBehindSessionStore(backend, max_pending=64, bound_s=None)
        backend.gate.clear()
        for i in range(5):
            await turn(store, f"c{i}", 0, "hi")
            await turn(store, f"c{i}", 1, "again")
        asyncio.get_running_loop().call_soon(backend.gate.set)
        await store.close()
        assert backend.closed_with == {f"c{i}": 2 for i in range(5)}

    asyncio.run(main())


def test_delete_cancels_queued_turns_and_lets_the_one_in_flight_land_first() -> None:
    async def story(backend: PacedStore, store: WriteBehindSessionStore, _: ManualClock) -> None:
        backend.gate.clear()
        await turn(store, "d", 0, "d0")
        await turn(store, "d", 1, "d1")
        await asyncio.sleep(0)  # the flusher takes d0 and waits at the gate
        deleting = asyncio.ensure_future(store.delete("d", tenant=T))
        await asyncio.sleep(0)
        backend.gate.set()
        assert await deleting
        await store.flush()
        assert await store.get("d", tenant=T) is None
        assert await backend.get("d", tenant=T) is None
        assert store.stats().num_pending == 0

    run(story)


def test_levels_through_the_factory_and_their_metrics() -> None:
    async def main() -> None:
        strong = create_session_store("memory://")
        assert isinstance(strong, MemorySessionStore)
        store = create_session_store("memory://", consistency="session", flush_bound_s=0.05)
        assert isinstance(store, WriteBehindSessionStore)
        metrics = ServerMetrics("m")
        metrics.watch_session_writes(store.stats)
        await turn(store, "m", 0, "hello")
        await store.flush()
        assert metrics.session_writes is not None
        metrics.session_writes.refresh()  # what a scrape does
        text = metrics.registry
        assert text.get_sample_value("strata:session_write_turns_total", {
            "model_name": "m", "level": "session", "outcome": "flushed"}) == 1.0
        assert text.get_sample_value("strata:session_write_bound_seconds", {
            "model_name": "m", "level": "session"}) == 0.05
        assert text.get_sample_value("strata:session_write_pending", {
            "model_name": "m", "level": "session"}) == 0.0
        await store.close()

    asyncio.run(main())


def test_the_instance_refuses_a_turn_the_queue_cannot_take_before_it_generates() -> None:
    async def story(backend: PacedStore, store: WriteBehindSessionStore, _: ManualClock) -> None:
        backend.gate.clear()
        await turn(store, "full", 0, "queued")
        config = ServerConfig(served_model_name="m")
        sessions = Sessions(store, config, 64, None)  # type: ignore[arg-type]
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(SessionStoreUnavailableError) as refused:
            await sessions.begin(None, req, "other")  # type: ignore[arg-type]  # refused first
        mapping = map_exception(refused.value)
        assert (mapping.status_code, mapping.payload()["error"]["type"]) == (
            503, "service_unavailable_error")
        assert "the write-behind queue holds 1" in mapping.payload()["error"]["message"]
        backend.gate.set()

    run(story, bound_s=None, max_pending=1)


def test_a_server_config_with_an_unknown_level_or_bound_is_refused_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match="one of strong, session, eventual, got 'linear'"):
        ServerConfig(served_model_name="m", session_consistency="linear")
    with pytest.raises(ConfigError, match="flush bound must be > 0 s"):
        ServerConfig(served_model_name="m", session_consistency="session",
                     session_flush_bound_s=0.0)
