"""A highly available Redis behind the stores: `redis+sentinel://` URLs (strata/state/redis_db.py)
against a real primary, two replicas and three Sentinels on the loopback
(tests/harness/redis_sentinel.py).

The failover story: sessions written concurrently with `redis_replicas=1` (each turn acknowledged
once a replica holds it), the primary SIGKILLed in the middle; the writers carry on through the
failover; afterwards every acknowledged turn is in its session, in order, and the stores serve
again, the failover time printed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.redis_sentinel import SentinelGroup
from redis_server import redis_server_binary

from strata.errors import ConfigError, SessionStoreUnavailableError
from strata.state.pins import PinStore, create_pin_store
from strata.state.redis_db import SentinelUrl
from strata.state.sessions import SessionConflictError, SessionStore, create_session_store
from strata.state.urls import scheme_of


def test_a_sentinel_url_names_its_sentinels_service_db_and_credentials() -> None:
    url = SentinelUrl.parse("redis+sentinel://:s3cret@10.0.0.1:26379,[::1]:26380/main/2"
                            "?sentinel_password=other")
    assert url.sentinels == (("10.0.0.1", 26379), ("::1", 26380))
    assert (url.service, url.db, url.username, url.password, url.sentinel_password) == (
        "main", 2, None, "s3cret", "other")
    assert "s3cret" not in url.redacted() and "other" not in url.redacted()
    assert SentinelUrl.parse("redis+sentinel://h:1/svc").db == 0
    assert scheme_of("sessions", "redis+sentinel://h:1/svc").backend == "redis"
    for bad, says in (("redis+sentinel://h/svc", "HOST:PORT"),
                      ("redis+sentinel://h:1", "/SERVICE"),
                      ("redis+sentinel://h:1/svc/x", "/SERVICE/DB"),
                      ("redis+sentinel://h:1/svc?timeout=1", "unknown parameter")):
        with pytest.raises(ConfigError, match=says):
            SentinelUrl.parse(bad)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    sentinels = SentinelGroup(tmp_path, redis_server_binary())
    sentinels.start()
    yield sentinels
    sentinels.stop()


async def _writer(store: SessionStore, session_id: str, acked: list[str], stop: asyncio.Event,
                  errors: list[str]) -> None:
    """Appends turns "t0", "t1", ... until `stop`; a turn is in `acked` once append returned.
    After an error the revision is read again (an unacknowledged turn may or may not be in)."""
    revision, n = 0, 0
    while not stop.is_set():
        try:
            record = await store.append(session_id, tenant="t", expected_revision=revision,
                                        messages=[{"role": "user", "content": f"t{n}"}],
                                        model="m", version="v1", ttl_s=None)
            revision = record.revision
            acked.append(f"t{n}")
        except (SessionStoreUnavailableError, SessionConflictError) as exc:
            errors.append(type(exc).__name__)
            await asyncio.sleep(0.05)
            try:
                current = await store.get(session_id, tenant="t")
                revision = current.revision if current is not None else 0
            except SessionStoreUnavailableError:
                pass
        n += 1
        await asyncio.sleep(0.005)


def test_a_primary_killed_under_writes_loses_no_acknowledged_turn(group: SentinelGroup) -> None:
    async def story(store: SessionStore, pins: PinStore) -> None:
        stop = asyncio.Event()
        acked: dict[str, list[str]] = {f"s{i}": [] for i in range(4)}
        errors: list[str] = []
        writers = [asyncio.create_task(_writer(store, sid, turns, stop, errors))
                   for sid, turns in acked.items()]
        await asyncio.sleep(1.0)
        before = sum(len(t) for t in acked.values())
        assert before > 0 and not errors, errors
        old = group.kill_primary()
        failover_s = await asyncio.to_thread(group.wait_for_failover, old)
        killed_at_count = sum(len(t) for t in acked.values())
        serving_again = time.monotonic()
        while sum(len(t) for t in acked.values()) < killed_at_count + 8:  # writes go on
            assert time.monotonic() - serving_again < 15.0, ("the writers never recovered", errors)
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*writers)
        assert errors, "the kill must have hit a write (else this proves nothing)"
        print(f"failover {failover_s:.2f} s; {before} turns before the kill, "
              f"{sum(len(t) for t in acked.values())} acknowledged in all; errors: "
              f"{sorted(set(errors))}")
        for session_id, turns in acked.items():
            record = await store.get(session_id, tenant="t")
            assert record is not None
            stored = [m["content"] for m in record.messages]
            positions = [stored.index(t) for t in turns if t in stored]
            assert len(positions) == len(turns), (session_id, set(turns) - set(stored))
            assert positions == sorted(positions)  # in the order they were acknowledged
        assert await pins.set_if("session-a", "instance-1", expected=None)  # another store too
        assert await pins.get("session-a") == "instance-1"

    asyncio.run(_with_stores(story, create_session_store(group.url, redis_replicas=1),
                             create_pin_store(group.url)))


async def _with_stores(story: Any, *stores: SessionStore | PinStore) -> None:
    """`story(*stores)` on this loop, the stores closed on it afterwards."""
    try:
        await story(*stores)
    finally:
        for store in stores:
            await store.close()


def test_with_no_replica_to_hold_it_a_turn_is_not_acknowledged(group: SentinelGroup) -> None:
    """`redis_replicas=1` waits for a replica: with both replicas stopped the append is the
    store's error within the wait (the turn is not reported stored), and a plain store writes."""
    for server in group.servers[1:]:
        server.stop(kill=True)
    async def story(strong: SessionStore, plain: SessionStore) -> None:
        started = time.monotonic()
        with pytest.raises(SessionStoreUnavailableError, match="0 of 1 replica"):
            await strong.append("s", tenant="t", expected_revision=0,
                                messages=[{"role": "user", "content": "hi"}], model="m",
                                version="v1", ttl_s=None)
        assert time.monotonic() - started < 10.0  # bounded by the 2 s wait, never a hang
        record = await plain.append("p", tenant="t", expected_revision=0,
                                    messages=[{"role": "user", "content": "hi"}], model="m",
                                    version="v1", ttl_s=None)
        assert record.revision == 1

    asyncio.run(_with_stores(story, create_session_store(group.url, redis_replicas=1),
                             create_session_store(group.url)))
