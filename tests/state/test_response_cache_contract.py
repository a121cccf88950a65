"""The response cache contract, run over memory, SQLite (WAL) and a real Redis: bytes in, the same
bytes out; TTL on an injected clock (Redis: the server's real expiry); entries over the size cap
refused and counted; the bounds of each backend; backend failures as ResponseCacheError."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from redis_server import free_port, redis_server, redis_url  # noqa: F401

from strata.clock import ManualClock
from strata.errors import ConfigError, ResponseCacheError
from strata.state.response_cache import (
    MemoryResponseCache,
    ResponseCache,
    SqliteResponseCache,
    create_response_cache,
)
from strata.state.response_cache.redis import RedisResponseCache

TTL_S = 10.0
ALL_BYTES = bytes(range(256)) + b"\xff\xfe\x00 not utf-8 \xc3\x28"


Factory = Callable[..., ResponseCache]  # each call: another client of the same cache


@pytest.fixture(params=["memory", "sqlite", "redis"])
def caches(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Factory, ManualClock, str]:
    """(factory, clock, unique key prefix); the factory takes max_entry_bytes."""
    clock = ManualClock(1000.0)
    prefix = f"infer:test-{uuid.uuid4().hex[:8]}:v1:"
    if request.param == "memory":
        shared: dict[int, MemoryResponseCache] = {}

        def memory(max_entry_bytes: int = 1024) -> ResponseCache:
            return shared.setdefault(max_entry_bytes, MemoryResponseCache(
                ttl_s=TTL_S, max_entry_bytes=max_entry_bytes, clock=clock))
        return memory, clock, prefix
    if request.param == "sqlite":
        def sqlite(max_entry_bytes: int = 1024) -> ResponseCache:
            return SqliteResponseCache(tmp_path / "responses.db", ttl_s=TTL_S,
                                       max_entry_bytes=max_entry_bytes, clock=clock)
        return sqlite, clock, prefix
    url = request.getfixturevalue("redis_url")

    def redis(max_entry_bytes: int = 1024) -> ResponseCache:
        return RedisResponseCache(url, ttl_s=TTL_S, max_entry_bytes=max_entry_bytes)
    return redis, clock, prefix


def run(clients: list[ResponseCache], work: Awaitable[None]) -> None:
    async def closing() -> None:
        try:
            await work
        finally:
            for client in clients:
                await client.close()

    asyncio.run(closing())


def test_values_come_back_byte_for_byte_and_a_put_replaces(
        caches: tuple[Factory, ManualClock, str]) -> None:
    factory, _, prefix = caches
    cache = factory()

    async def story() -> None:
        assert await cache.get(prefix + "a") is None
        assert await cache.put(prefix + "a", ALL_BYTES) is True
        assert await cache.put(prefix + "empty", b"") is True
        assert await cache.get(prefix + "a") == ALL_BYTES
        assert await cache.get(prefix + "empty") == b""
        assert await cache.put(prefix + "a", b'{"id":"second"}') is True
        assert await cache.get(prefix + "a") == b'{"id":"second"}'
        assert await cache.get(prefix + "b") is None

    run([cache], story())


def test_another_client_of_the_same_cache_reads_the_entry(
        caches: tuple[Factory, ManualClock, str]) -> None:
    factory, _, prefix = caches
    writer, reader = factory(), factory()

    async def story() -> None:
        await writer.put(prefix + "k", b"shared")
        assert await reader.get(prefix + "k") == b"shared"

    run([writer, reader], story())


def test_values_over_max_entry_bytes_are_refused_and_counted(
        caches: tuple[Factory, ManualClock, str]) -> None:
    factory, _, prefix = caches
    cache = factory(max_entry_bytes=100)

    async def story() -> None:
        assert await cache.put(prefix + "big", b"x" * 101) is False
        assert await cache.put(prefix + "fits", b"x" * 100) is True
        assert await cache.put(prefix + "big", b"y" * 500) is False
        assert cache.num_too_large == 2
        assert await cache.get(prefix + "big") is None
        assert await cache.get(prefix + "fits") == b"x" * 100

    run([cache], story())


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_entries_expire_on_the_injected_clock(kind: str, tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    url = "memory://" if kind == "memory" else f"sqlite://{tmp_path}/responses.db"
    cache = create_response_cache(url, ttl_s=TTL_S, clock=clock)

    async def story() -> None:
        await cache.put("default", b"d")
        await cache.put("short", b"s", ttl_s=2.0)
        clock.now += 1.999
        assert (await cache.get("default"), await cache.get("short")) == (b"d", b"s")
        clock.now += 0.001
        assert (await cache.get("default"), await cache.get("short")) == (b"d", None)
        clock.now += TTL_S - 2.0 - 0.001
        assert await cache.get("default") == b"d"
        clock.now += 0.001
        assert await cache.get("default") is None
        await cache.put("default", b"again")  # an expired key is stored afresh
        assert await cache.get("default") == b"again"

    run([cache], story())


def test_redis_entries_expire_by_the_server_ttl(redis_url: str) -> None:  # noqa: F811
    cache = RedisResponseCache(redis_url, ttl_s=TTL_S)
    key = f"infer:ttl-{uuid.uuid4().hex[:8]}:v1:k"

    async def story() -> None:
        await cache.put(key, b"soon gone", ttl_s=0.3)
        assert await cache.get(key) == b"soon gone"
        ttl_ms = await cache._client.pttl(key)
        assert 0 < ttl_ms <= 300
        deadline = time.monotonic() + 5.0
        while await cache.get(key) is not None:
            assert time.monotonic() < deadline, "redis did not expire the entry within 5 s"
            await asyncio.sleep(0.05)
        await cache.put(key, b"default ttl")
        assert 9_000 < await cache._client.pttl(key) <= 10_000

    run([cache], story())


def test_memory_evicts_the_least_recently_used_past_max_bytes() -> None:
    cache = MemoryResponseCache(max_bytes=300, max_entry_bytes=100)

    async def story() -> None:
        for key in ("a", "b", "c"):
            await cache.put(key, key.encode() * 100)
        assert await cache.get("a") == b"a" * 100  # a is now the most recently used
        await cache.put("d", b"d" * 50)
        assert [await cache.get(k) is not None for k in "abcd"] == [True, False, True, True]
        assert (len(cache), cache.num_bytes) == (3, 250)
        await cache.put("a", b"A" * 100)  # replacing counts the new size, not both
        assert (len(cache), cache.num_bytes) == (3, 250)
        await cache.put("e", b"e" * 100)  # c is now the least recently used
        assert [await cache.get(k) is not None for k in "acde"] == [True, False, True, True]
        assert (len(cache), cache.num_bytes) == (3, 250)

    run([cache], story())


def test_memory_evicts_the_least_recently_used_past_max_entries() -> None:
    cache = MemoryResponseCache(max_entries=2)

    async def story() -> None:
        await cache.put("a", b"1")
        await cache.put("b", b"2")
        await cache.get("a")
        await cache.put("c", b"3")
        assert [await cache.get(k) for k in "abc"] == [b"1", None, b"3"]
        assert (len(cache), cache.num_bytes) == (2, 2)

    run([cache], story())


def test_sqlite_prunes_expired_then_oldest_stored_past_max_bytes(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    path = tmp_path / "responses.db"
    cache = SqliteResponseCache(path, ttl_s=TTL_S, max_bytes=300, max_entry_bytes=100,
                                clock=clock)

    async def keys() -> list[str]:
        rows = await cache._db.call(lambda c: c.execute(
            "SELECT key FROM response_cache ORDER BY stored_at").fetchall())
        return [str(row[0]) for row in rows]

    async def story() -> None:
        await cache.put("short", b"s" * 10, ttl_s=5.0)
        for key in ("a", "b", "c"):
            clock.now += 0.5
            await cache.put(key, key.encode() * 90)
        assert await keys() == ["short", "a", "b", "c"]  # 280 bytes
        await cache.get("a")  # reads do not reorder (oldest stored goes first)
        clock.now += 5.0  # short expires
        await cache.put("d", b"d" * 100)
        assert await keys() == ["b", "c", "d"]  # short expired; a was the oldest past 300
        assert [await cache.get(k) is not None for k in "abcd"] == [False, True, True, True]

    run([cache], story())


def test_close_then_a_new_client_still_finds_persistent_entries(tmp_path: Path,
                                                                redis_url: str) -> None:  # noqa: F811
    key = f"infer:close-{uuid.uuid4().hex[:8]}:v1:k"
    for url in (f"sqlite://{tmp_path}/responses.db", redis_url):
        first, second = create_response_cache(url), create_response_cache(url)

        async def story(first: ResponseCache = first, second: ResponseCache = second) -> None:
            await first.put(key, b"kept")
            await first.close()
            assert await second.get(key) == b"kept"

        run([second], story())


def test_memory_close_drops_everything() -> None:
    cache = MemoryResponseCache()

    async def story() -> None:
        await cache.put("k", b"v")
        await cache.close()
        assert (await cache.get("k"), len(cache), cache.num_bytes) == (None, 0, 0)

    asyncio.run(story())


def test_backend_failures_raise_response_cache_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    dead_redis = RedisResponseCache(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    bad_sqlite = SqliteResponseCache(tmp_path / "a-file" / "responses.db")

    async def story() -> None:
        for cache in (dead_redis, bad_sqlite):
            with pytest.raises(ResponseCacheError, match="response cache"):
                await cache.get("k")
            with pytest.raises(ResponseCacheError, match="response cache"):
                await cache.put("k", b"v")

    run([dead_redis, bad_sqlite], story())


def test_factory_names_the_valid_schemes_and_checks_limits() -> None:
    with pytest.raises(ConfigError, match=r"use one of: memory://, sqlite:///PATH, "
                                          r"redis://HOST:PORT/DB, rediss://HOST:PORT/DB"):
        create_response_cache("postgres://db")
    with pytest.raises(ConfigError, match="needs an absolute path"):
        create_response_cache("sqlite://relative.db")
    with pytest.raises(ConfigError, match="ttl_s must be positive"):
        create_response_cache("memory://", ttl_s=0)
    with pytest.raises(ConfigError, match="max_entry_bytes <= max_bytes"):
        create_response_cache("memory://", max_bytes=10, max_entry_bytes=11)
    with pytest.raises(ConfigError, match="max_entries must be positive"):
        create_response_cache("memory://", max_entries=0)
    cache = create_response_cache("memory", ttl_s=5.0, max_bytes=1000, max_entry_bytes=10)
    assert isinstance(cache, MemoryResponseCache)
    assert (cache.ttl_s, cache.max_bytes, cache.max_entry_bytes) == (5.0, 1000, 10)
