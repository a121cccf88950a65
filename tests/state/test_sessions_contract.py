"""One contract for every SessionStore backend: memory, SQLite (WAL) and a real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis_server import redis_server, redis_url  # noqa: F401

from strata.clock import ManualClock
from strata.errors import ConfigError, SessionConflictError, SessionNotFoundError
from strata.state import SessionStore, create_session_store

ALICE, BOB = "tenant-alice", "tenant-bob"


@dataclass
class Backend:
    url: str
    clock: ManualClock | None  # None: real time (Redis expires keys on its own clock)

    def run(self, story: Callable[[SessionStore], Awaitable[None]]) -> None:
        """Run `story` on a fresh store of this backend, in its own event loop."""
        async def main() -> None:
            store = create_session_store(self.url, clock=self.clock or time.time)
            try:
                await story(store)
            finally:
                await store.close()

        asyncio.run(main())


@pytest.fixture(params=["memory", "sqlite", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "memory":
        return Backend("memory://", ManualClock(1000.0))
    if request.param == "sqlite":
        return Backend(f"sqlite:///{tmp_path}/s.db", ManualClock(1000.0))
    return Backend(request.getfixturevalue("redis_url"), None)


def sid() -> str:
    return f"s-{uuid.uuid4().hex[:8]}"


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


async def add(store: SessionStore, session_id: str, revision: int, *texts: str,
              tenant: str = ALICE, ttl_s: float | None = None) -> int:
    record = await store.append(session_id, tenant=tenant, expected_revision=revision,
                                messages=[user(t) for t in texts], model="m", version="v1",
                                ttl_s=ttl_s)
    return record.revision


def test_created_at_revision_0_then_one_revision_per_append(backend: Backend) -> None:
    async def story(store: SessionStore) -> None:
        s = sid()
        assert await store.get(s, tenant=ALICE) is None
        first = await store.append(s, tenant=ALICE, expected_revision=0,
                                   messages=[{"role": "system", "content": "be brief"}, user("hi")],
                                   model="tiny", version="v1", ttl_s=None)
        assert (first.revision, first.session_id, first.tenant) == (1, s, ALICE)
        assert first.messages == ({"role": "system", "content": "be brief"}, user("hi"))
        assert await add(store, s, 1, "again", "and again") == 2
        got = await store.get(s, tenant=ALICE)
        assert got is not None and got.revision == 2 and got.model == "m" and got.version == "v1"
        assert [m["content"] for m in got.messages] == ["be brief", "hi", "again", "and again"]
        assert got.created_at == first.created_at and got.updated_at >= got.created_at

    backend.run(story)


def test_a_stale_revision_is_a_conflict_and_changes_nothing(backend: Backend) -> None:
    async def story(store: SessionStore) -> None:
        s = sid()
        await add(store, s, 0, "one")
        await add(store, s, 1, "two")
        with pytest.raises(SessionConflictError) as err:
            await add(store, s, 1, "lost?")
        assert (err.value.expected_revision, err.value.actual_revision) == (1, 2)
        with pytest.raises(SessionConflictError):
            await add(store, s, 0, "create again?")
        with pytest.raises(SessionNotFoundError):
            await add(store, sid(), 3, "never created")
        got = await store.get(s, tenant=ALICE)
        assert got is not None and [m["content"] for m in got.messages] == ["one", "two"]

    backend.run(story)


def test_concurrent_appends_one_winner_per_revision(backend: Backend) -> None:
    async def story(store: SessionStore) -> None:
        s = sid()
        await add(store, s, 0, "start")
        results = await asyncio.gather(*(add(store, s, 1, f"racer {i}") for i in range(20)),
                                       return_exceptions=True)
        winners = [r for r in results if not isinstance(r, BaseException)]
        assert winners == [2]
        assert all(isinstance(r, SessionConflictError) for r in results if r not in winners)

    backend.run(story)


def test_losers_that_retry_lose_no_message(backend: Backend) -> None:
    async def story(store: SessionStore) -> None:
        s = sid()
        num_conflicts = 0

        async def writer(i: int) -> None:
            nonlocal num_conflicts
            while True:  # read-modify-CAS
                record = await store.get(s, tenant=ALICE)
                await asyncio.sleep(0)  # the "modify" step: let the other writers read too
                try:
                    await add(store, s, record.revision if record else 0, f"w{i}")
                    return
                except SessionConflictError:
                    num_conflicts += 1

        await asyncio.gather(*(writer(i) for i in range(20)))
        got = await store.get(s, tenant=ALICE)
        assert got is not None and got.revision == 20
        assert sorted(m["content"] for m in got.messages) == sorted(f"w{i}" for i in range(20))
        assert num_conflicts > 0  # the race really happened

    backend.run(story)


def test_another_tenant_sees_nothing_and_cannot_delete(backend: Backend) -> None:
    async def story(store: SessionStore) -> None:
        s = sid()
        await add(store, s, 0, "alice's secret")
        assert await store.get(s, tenant=BOB) is None
        assert await store.delete(s, tenant=BOB) is False
        assert [r.session_id for r in await store.list(tenant=BOB)] == []
        with pytest.raises(SessionNotFoundError):
            await add(store, s, 1, "bob writes into alice's session?", tenant=BOB)
        # the same id is Bob's own, independent session
        assert await add(store, s, 0, "bob's own", tenant=BOB) == 1
        alice, bob = await store.get(s, tenant=ALICE), await store.get(s, tenant=BOB)
        assert alice is not None and [m["content"] for m in alice.messages] == ["alice's secret"]
        assert bob is not None and [m["content"] for m in bob.messages] == ["bob's own"]

    backend.run(story)


def test_delete_then_the_id_starts_over(backend: Backend) -> None:
    async def story(store: SessionStore) -> None:
        s = sid()
        await add(store, s, 0, "one")
        assert await store.delete(s, tenant=ALICE) is True
        assert await store.delete(s, tenant=ALICE) is False
        assert await store.get(s, tenant=ALICE) is None
        with pytest.raises(SessionNotFoundError):
            await add(store, s, 1, "after delete")
        assert await add(store, s, 0, "fresh") == 1

    backend.run(story)


def test_list_by_tenant_most_recent_first(backend: Backend) -> None:
    async def story(store: SessionStore) -> None:
        ids = [sid() for _ in range(3)]
        for i, s in enumerate(ids):
            if backend.clock is not None:
                backend.clock.now += 1
            else:
                await asyncio.sleep(0.01)
            await add(store, s, 0, f"n{i}")
        await add(store, sid(), 0, "bob", tenant=BOB)
        mine = await store.list(tenant=ALICE)
        assert [r.session_id for r in mine if r.session_id in ids] == ids[::-1]
        assert all(r.tenant == ALICE for r in mine)
        assert len(await store.list(tenant=ALICE, limit=2)) == 2
        everyone = {(r.tenant, r.session_id) for r in await store.list(limit=1000)}
        assert {(ALICE, s) for s in ids} <= everyone and any(t == BOB for t, _ in everyone)

    backend.run(story)


def test_ttl_expiry_and_each_append_extends_it(backend: Backend) -> None:
    async def story(store: SessionStore) -> None:
        s, gone = sid(), sid()
        if backend.clock is None:  # real Redis: PEXPIRE
            await add(store, gone, 0, "short-lived", ttl_s=0.2)
            await add(store, s, 0, "kept", ttl_s=60)
            deadline = time.monotonic() + 10
            while await store.get(gone, tenant=ALICE) is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        else:
            await add(store, gone, 0, "short-lived", ttl_s=10)
            await add(store, s, 0, "kept", ttl_s=10)
            backend.clock.now += 8
            await add(store, s, 1, "extends", ttl_s=10)
            backend.clock.now += 5  # gone: 13 s old; s: 5 s after its last append
        assert await store.get(gone, tenant=ALICE) is None
        assert gone not in [r.session_id for r in await store.list(tenant=ALICE)]
        assert await store.delete(gone, tenant=ALICE) is False
        assert await add(store, gone, 0, "reborn", ttl_s=60) == 1  # an expired id starts over
        assert await store.get(s, tenant=ALICE) is not None

    backend.run(story)


def test_messages_round_trip_as_json(backend: Backend) -> None:
    async def story(store: SessionStore) -> None:
        s = sid()
        odd = {"role": "user", "content": "ünïcode \"quotes\" \n newline", "name": "x:y"}
        await store.append(s, tenant="t:with:colons", expected_revision=0, messages=[odd],
                           model="m", version="v", ttl_s=None)
        got = await store.get(s, tenant="t:with:colons")
        assert got is not None and got.messages == (odd,)
        assert await store.get(s, tenant="t") is None

    backend.run(story)


def test_unknown_url_and_bad_arguments_say_what_to_change(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="memory://"):
        create_session_store("mongodb://x")
    with pytest.raises(ConfigError, match="absolute path"):
        create_session_store("sqlite://relative.db")
    with pytest.raises(ConfigError, match="always, everysec, no"):
        create_session_store("redis://127.0.0.1:1/0", redis_appendfsync="sometimes")


def test_negative_ttl_is_refused(backend: Backend) -> None:
    async def story(store: SessionStore) -> None:
        with pytest.raises(ConfigError, match="ttl_s"):
            await add(store, "s", 0, "x", ttl_s=-1)

    backend.run(story)
