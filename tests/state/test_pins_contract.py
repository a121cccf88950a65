"""The pin store contract, run over memory, SQLite (WAL) and a real Redis: compare-and-set,
sliding expiry on an injected clock, per-instance counts, and races with exactly one winner."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from redis_server import redis_server, redis_url  # noqa: F401

from strata.clock import ManualClock
from strata.errors import ConfigError
from strata.state.pins import MemoryPinStore, PinStore, SqlitePinStore, create_pin_store
from strata.state.pins.redis import RedisPinStore

TTL_S = 10.0
_prefixes = itertools.count()


Factory = Callable[[], PinStore]  # each call: another client of the same table


@pytest.fixture(params=["memory", "sqlite", "redis"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Factory, ManualClock]:
    clock = ManualClock(1000.0)
    if request.param == "memory":
        shared = MemoryPinStore(ttl_s=TTL_S, clock=clock)
        return (lambda: shared), clock
    if request.param == "sqlite":
        return (lambda: SqlitePinStore(tmp_path / "pins.db", ttl_s=TTL_S, clock=clock)), clock
    url = request.getfixturevalue("redis_url")
    prefix = f"test:pins:{next(_prefixes)}"
    return (lambda: RedisPinStore(url, ttl_s=TTL_S, clock=clock, prefix=prefix)), clock


async def closing(clients: list[PinStore], work: Awaitable[object]) -> object:
    try:
        return await work
    finally:
        for client in clients:
            await client.close()


def test_compare_and_set_story(stores: tuple[Factory, ManualClock]) -> None:
    factory, _ = stores

    pins = factory()

    async def story() -> None:
        assert await pins.get("s1") is None
        assert await pins.set_if("s1", "a", expected=None) is True
        assert await pins.set_if("s1", "b", expected=None) is False  # already pinned
        assert await pins.get("s1") == "a"
        assert await pins.set_if("s1", "c", expected="b") is False  # wrong expectation
        assert await pins.set_if("s1", "b", expected="a") is True
        assert await pins.set_if("s2", "b", expected=None) is True
        assert await pins.set_if("s3", "a", expected=None) is True
        assert await pins.counts() == {"a": 1, "b": 2}
        await pins.delete("s1")
        await pins.delete("never-pinned")
        assert await pins.get("s1") is None
        assert await pins.counts() == {"a": 1, "b": 1}
        assert await pins.set_if("s1", "c", expected=None) is True

    asyncio.run(closing([pins], story()))


def test_pins_expire_when_idle_and_reads_slide_the_expiry(
        stores: tuple[Factory, ManualClock]) -> None:
    factory, clock = stores

    pins = factory()

    async def story() -> None:
        await pins.set_if("busy", "a", expected=None)
        await pins.set_if("idle", "b", expected=None)
        clock.now += TTL_S - 1
        assert await pins.get("busy") == "a"  # slides to now + TTL_S
        clock.now += TTL_S - 1
        assert await pins.get("busy") == "a"
        assert await pins.get("idle") is None  # unused for 2 * TTL_S - 2 > TTL_S
        assert await pins.counts() == {"a": 1}
        assert await pins.set_if("idle", "c", expected="b") is False  # its old pin is gone
        assert await pins.set_if("idle", "c", expected=None) is True
        clock.now += TTL_S
        assert await pins.counts() == {}

    asyncio.run(closing([pins], story()))


def test_racing_creates_and_swaps_have_exactly_one_winner(
        stores: tuple[Factory, ManualClock]) -> None:
    factory, _ = stores

    clients = [factory() for _ in range(8)]

    async def story() -> None:
        creates = await asyncio.gather(*[
            c.set_if("race", f"i{n}", expected=None) for n, c in enumerate(clients)])
        assert creates.count(True) == 1
        winner = f"i{creates.index(True)}"
        assert await clients[0].get("race") == winner
        swaps = await asyncio.gather(*[
            c.set_if("race", f"j{n}", expected=winner) for n, c in enumerate(clients)])
        assert swaps.count(True) == 1
        assert await clients[-1].get("race") == f"j{swaps.index(True)}"
        assert await clients[0].counts() == {f"j{swaps.index(True)}": 1}

    asyncio.run(closing(clients, story()))


def test_many_sessions_raced_by_many_clients_all_count_once(
        stores: tuple[Factory, ManualClock]) -> None:
    factory, _ = stores

    clients = [factory() for _ in range(4)]

    async def story() -> dict[str, int]:
        wins = await asyncio.gather(*[c.set_if(f"s{s}", f"i{n}", expected=None)
                                      for s in range(25) for n, c in enumerate(clients)])
        assert wins.count(True) == 25
        return await clients[0].counts()

    counts = asyncio.run(closing(clients, story()))
    assert isinstance(counts, dict) and sum(counts.values()) == 25


def test_factory_urls(tmp_path: Path, redis_url: str) -> None:  # noqa: F811
    assert isinstance(create_pin_store("memory://"), MemoryPinStore)
    assert isinstance(create_pin_store(f"sqlite://{tmp_path}/p.db"), SqlitePinStore)
    redis_store = create_pin_store(redis_url)
    assert isinstance(redis_store, RedisPinStore)
    asyncio.run(redis_store.close())
    with pytest.raises(ConfigError, match="absolute path"):
        create_pin_store("sqlite://relative.db")
    with pytest.raises(ConfigError, match="memory://, sqlite:///PATH, redis://"):
        create_pin_store("etcd://x")
    with pytest.raises(ConfigError, match="positive"):
        create_pin_store("memory://", ttl_s=0)


@pytest.mark.parametrize("scheme", ["sqlite", "redis"])
def test_namespaces_share_a_backend_not_their_pins(scheme: str, tmp_path: Path,
                                                   request: pytest.FixtureRequest) -> None:
    """Session -> instance pins and session -> version pins live side by side in one store."""
    url = (f"sqlite:///{tmp_path / 'pins.db'}" if scheme == "sqlite"
           else request.getfixturevalue("redis_url"))
    instances = create_pin_store(url, namespace="pins")
    versions = create_pin_store(url, namespace="versions")

    async def story() -> None:
        await instances.delete("s1")
        await versions.delete("s1")
        assert await instances.set_if("s1", "instance-0", expected=None) is True
        assert await versions.set_if("s1", "v1", expected=None) is True
        assert await instances.get("s1") == "instance-0"
        assert await versions.get("s1") == "v1"
        assert await versions.counts() == {"v1": 1}
        await versions.delete("s1")
        assert await instances.get("s1") == "instance-0"

    asyncio.run(closing([instances, versions], story()))


def test_a_namespace_must_be_an_identifier() -> None:
    with pytest.raises(ConfigError, match="identifier"):
        create_pin_store("memory://", namespace="x; DROP TABLE")
