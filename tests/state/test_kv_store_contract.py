"""One contract for every KVStore backend: memory and a real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
from redis_server import redis_server, redis_url  # noqa: F401

from strata.clock import ManualClock
from strata.errors import ConfigError, KVStoreUnavailableError
from strata.state.kv_store import KVStore, KVStoreLimits, create_kv_store
from strata.types import BlockHash

H = [BlockHash(bytes([i]) * 16) for i in range(8)]


def payload(i: int, size: int = 100) -> bytes:
    return bytes([i]) * size


@pytest.fixture(params=["memory", "redis"])
def open_store(request: pytest.FixtureRequest) -> Callable[..., KVStore]:
    """A factory of fresh stores of the backend (Redis: a key prefix of their own). `clock`
    drives the memory store's expiry; Redis expires keys on its own clock."""
    if request.param == "memory":
        return lambda clock=time.monotonic, **limits: create_kv_store(
            "memory://", limits=KVStoreLimits(**limits), clock=clock)
    url = request.getfixturevalue("redis_url")
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    return lambda clock=None, **limits: create_kv_store(url, limits=KVStoreLimits(**limits),
                                                        key_prefix=prefix)


def run(store: KVStore, story: Callable[[KVStore], Awaitable[None]]) -> None:
    async def main() -> None:
        try:
            await story(store)
        finally:
            await store.close()

    asyncio.run(main())


def test_a_fetch_returns_the_longest_leading_run(open_store: Callable[..., KVStore]) -> None:
    async def story(store: KVStore) -> None:
        assert await store.get_prefix(H) == []
        assert await store.put_many([(H[0], payload(0)), (H[1], payload(1)),
                                     (H[3], payload(3))]) == 3
        assert await store.get_prefix(H) == [payload(0), payload(1)]
        assert await store.count_prefix(H) == 2
        assert await store.count_prefix(H[3:4]) == 1
        assert await store.get_prefix([]) == [] and await store.count_prefix([]) == 0

    run(open_store(), story)


def test_a_long_prefix_is_read_across_chunks(open_store: Callable[..., KVStore]) -> None:
    hashes = [BlockHash(i.to_bytes(16, "little")) for i in range(40)]

    async def story(store: KVStore) -> None:
        await store.put_many([(h, payload(i % 256)) for i, h in enumerate(hashes) if i != 35])
        assert await store.get_prefix(hashes) == [payload(i % 256) for i in range(35)]
        assert await store.count_prefix(hashes) == 35

    run(open_store(), story)


def test_a_put_overwrites(open_store: Callable[..., KVStore]) -> None:
    async def story(store: KVStore) -> None:
        await store.put_many([(H[0], payload(0))])
        await store.put_many([(H[0], payload(9, 50))])
        assert await store.get_prefix(H[:1]) == [payload(9, 50)]

    run(open_store(), story)


def test_caps_keep_the_leading_blocks(open_store: Callable[..., KVStore]) -> None:
    async def story(store: KVStore) -> None:
        items = [(H[0], payload(0)), (H[1], payload(1, 300)), (H[2], payload(2))]
        assert await store.put_many(items) == 1  # block 1 is over the per-block cap
        assert await store.get_prefix(H) == [payload(0)]
        items = [(H[4], payload(4)), (H[5], payload(5)), (H[6], payload(6))]
        assert await store.put_many(items) == 2  # the third would pass 250 bytes in one put
        assert await store.get_prefix(H[4:]) == [payload(4), payload(5)]

    run(open_store(max_block_bytes=200, max_put_bytes=250), story)


def test_entries_expire_after_the_ttl(open_store: Callable[..., KVStore]) -> None:
    clock = ManualClock(1000.0)

    async def story(store: KVStore) -> None:
        await store.put_many([(H[0], payload(0))])
        assert await store.count_prefix(H) == 1
        clock.advance(1.0)  # the memory store's TTL has passed; Redis counts on its own clock
        for _ in range(500):  # Redis: bounded, until the key is gone
            if await store.count_prefix(H) == 0:
                break
            await asyncio.sleep(0.02)
        assert await store.get_prefix(H) == [] and await store.count_prefix(H) == 0

    run(open_store(clock=clock, ttl_s=1.0), story)


def test_the_memory_store_keeps_an_entry_until_its_ttl_on_its_clock() -> None:
    clock = ManualClock(1000.0)

    async def story(store: KVStore) -> None:
        await store.put_many([(H[0], payload(0))])
        clock.advance(0.99)
        assert await store.count_prefix(H) == 1
        clock.advance(0.01)
        assert await store.count_prefix(H) == 0

    run(create_kv_store("memory://", limits=KVStoreLimits(ttl_s=1.0), clock=clock), story)


def test_memory_store_evicts_least_recently_used_bytes() -> None:
    async def story(store: KVStore) -> None:
        await store.put_many([(H[0], payload(0)), (H[1], payload(1)), (H[2], payload(2))])
        assert await store.get_prefix(H[:1]) == [payload(0)]  # H[0] is now most recent
        await store.put_many([(H[3], payload(3))])  # 400 bytes > 300: evicts H[1]
        assert [await store.count_prefix([h]) for h in H[:4]] == [1, 0, 1, 1]

    run(create_kv_store("memory://", limits=KVStoreLimits(max_bytes=300)), story)


def test_redis_store_sets_maxmemory_and_lru_when_asked(redis_url: str) -> None:  # noqa: F811
    import redis

    client = redis.Redis.from_url(redis_url)
    before = client.config_get("maxmemory*")
    store = create_kv_store(redis_url, limits=KVStoreLimits(redis_maxmemory_bytes=64 << 20),
                            key_prefix=f"test:{uuid.uuid4().hex[:8]}")
    try:
        run(store, lambda s: s.put_many([(H[0], payload(0))]))
        config = client.config_get("maxmemory*")
        assert config["maxmemory"] == str(64 << 20)
        assert config["maxmemory-policy"] == "allkeys-lru"
    finally:
        for key in ("maxmemory", "maxmemory-policy"):
            client.config_set(key, before[key])
        client.close()


def test_an_unreachable_redis_is_unavailable_not_a_crash() -> None:
    from redis_server import free_port

    store = create_kv_store(f"redis://127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    with pytest.raises(KVStoreUnavailableError, match="redis KV store"):
        run(store, lambda s: s.get_prefix(H))
    assert time.monotonic() - started < 5


def test_bad_urls_and_limits_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="use one of: memory://, redis://"):
        create_kv_store("s3://bucket")
    with pytest.raises(ConfigError, match="kv ttl_s must be positive"):
        KVStoreLimits(ttl_s=0)
    with pytest.raises(ConfigError, match="kv max_put_bytes must be positive"):
        KVStoreLimits(max_put_bytes=0)
