"""The usage store contract (strata/state/usage/base.py), run over memory, one SQLite file and a
real Redis, two clients of one store each time (two gateways): counts added at once by both add
up exactly; `totals` starts at the minute `since` falls in; `take` admits exactly the window's
requests however the clients race, refuses once the charged tokens reach the limit, and a new
minute opens a new window; usage past the retention is gone."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from redis_server import redis_server, redis_url  # noqa: F401

from strata.clock import ManualClock
from strata.errors import ConfigError, UsageStoreError
from strata.state.usage import Counts, MemoryUsageStore, UsageStore, create_usage_store
from strata.state.usage.redis import RedisUsageStore
from strata.state.usage.sqlite import SqliteUsageStore

Pair = tuple[UsageStore, UsageStore, ManualClock]
RETENTION_S = 120.0


@pytest.fixture(params=["memory", "sqlite", "redis"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Pair:
    """Two clients of one store, on a clock 10 s into a real minute (Redis expires keys on the
    server's real clock, so the store's wall time must be near it)."""
    clock = ManualClock((time.time() // 60) * 60 + 10.0)
    if request.param == "memory":
        shared = MemoryUsageStore(clock=clock, retention_s=RETENTION_S)
        return shared, shared, clock
    if request.param == "sqlite":  # two connections to one file: two gateways on one machine
        path = tmp_path / "usage.db"
        return (SqliteUsageStore(path, clock=clock, retention_s=RETENTION_S),
                SqliteUsageStore(path, clock=clock, retention_s=RETENTION_S), clock)
    url = request.getfixturevalue("redis_url")
    prefix = f"strata:test-usage-{uuid.uuid4().hex[:8]}"
    return (RedisUsageStore(url, clock=clock, prefix=prefix, retention_s=RETENTION_S),
            RedisUsageStore(url, clock=clock, prefix=prefix, retention_s=RETENTION_S), clock)


def run(pair: Pair, work: Callable[[UsageStore, UsageStore, ManualClock], Awaitable[None]]
        ) -> None:
    one, two, clock = pair

    async def closing() -> None:
        try:
            await work(one, two, clock)
        finally:
            await one.close()
            await two.close()

    asyncio.run(closing())


def test_counts_added_at_once_by_two_clients_add_up_exactly(stores: Pair) -> None:
    async def work(one: UsageStore, two: UsageStore, clock: ManualClock) -> None:
        answer = Counts(requests=1, prompt_tokens=7, cached_tokens=3, completion_tokens=5)
        await asyncio.gather(*(store.add("t1", "sim", answer) for store in (one, two) * 20),
                             two.add("t2", "sim:sql", Counts(requests=1, errors=1)))
        assert await one.totals(clock() - 5) == {
            ("t1", "sim"): Counts(requests=40, prompt_tokens=280, cached_tokens=120,
                                  completion_tokens=200),
            ("t2", "sim:sql"): Counts(requests=1, errors=1)}

    run(stores, work)


def test_totals_start_at_the_minute_since_falls_in(stores: Pair) -> None:
    async def work(one: UsageStore, two: UsageStore, clock: ManualClock) -> None:
        await one.add("t", "m", Counts(requests=1, prompt_tokens=10))
        clock.advance(60.0)
        await two.add("t", "m", Counts(requests=1, completion_tokens=4))
        assert await one.totals(clock() - 5) == {("t", "m"): Counts(requests=1,
                                                                    completion_tokens=4)}
        assert await two.totals(clock() - 60) == {
            ("t", "m"): Counts(requests=2, prompt_tokens=10, completion_tokens=4)}

    run(stores, work)


def test_usage_past_the_retention_is_gone(stores: Pair) -> None:
    async def work(one: UsageStore, two: UsageStore, clock: ManualClock) -> None:
        await one.add("t", "m", Counts(requests=1))
        clock.advance(RETENTION_S + 120)
        await two.add("t", "m", Counts(requests=2))
        assert await one.totals(clock() - 3600) == {("t", "m"): Counts(requests=2)}

    run(stores, work)


def test_take_admits_exactly_the_window_s_requests_however_two_clients_race(
        stores: Pair) -> None:
    async def work(one: UsageStore, two: UsageStore, clock: ManualClock) -> None:
        windows = await asyncio.gather(*(store.take("t", max_requests=7, max_tokens=None)
                                         for store in (one, two) * 10))
        assert sum(w.is_admitted for w in windows) == 7
        assert sorted(w.num_requests for w in windows if w.is_admitted) == [1, 2, 3, 4, 5, 6, 7]
        assert {w.num_requests for w in windows if not w.is_admitted} == {7}
        assert windows[0].reset_s == pytest.approx(50.0)
        clock.advance(50.0)  # the next minute: a new window
        fresh = await two.take("t", max_requests=7, max_tokens=None)
        assert (fresh.is_admitted, fresh.num_requests, fresh.reset_s) == (True, 1, 60.0)

    run(stores, work)


def test_take_refuses_once_the_charged_tokens_reach_the_limit(stores: Pair) -> None:
    async def work(one: UsageStore, two: UsageStore, clock: ManualClock) -> None:
        assert (await one.take("t", max_requests=None, max_tokens=100)).is_admitted
        await two.charge("t", 99)
        window = await two.take("t", max_requests=None, max_tokens=100)
        assert (window.is_admitted, window.num_tokens) == (True, 99)  # 1 token left: admitted
        await one.charge("t", 30)  # its answer was longer: 29 over, by this one request
        refused = await one.take("t", max_requests=None, max_tokens=100)
        assert (refused.is_admitted, refused.num_requests, refused.num_tokens) == (False, 2, 129)
        assert (await one.take("other", max_requests=None, max_tokens=100)).is_admitted

    run(stores, work)


def test_the_factory_and_its_errors() -> None:
    assert isinstance(create_usage_store("memory://"), MemoryUsageStore)
    with pytest.raises(ConfigError, match="unknown usage store URL 'file:///u.db'; use one "
                                          "of: memory://, sqlite:///PATH, redis://"):
        create_usage_store("file:///u.db")
    with pytest.raises(ConfigError, match="sqlite usage store URL 'sqlite://u.db' needs an "
                                          "absolute path"):
        create_usage_store("sqlite://u.db")
    with pytest.raises(ConfigError, match="retention_s must be at least 60"):
        create_usage_store("memory://", retention_s=5)

    async def unreachable() -> None:
        store = create_usage_store("redis://127.0.0.1:1/0")
        try:
            with pytest.raises(UsageStoreError, match="redis usage store redis://127.0.0.1:1/0"):
                await store.add("t", "m", Counts(requests=1))
        finally:
            await store.close()

    asyncio.run(unreachable())
