"""One contract, three backends: memory, SQLite (a temp file) and Redis (a real server)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from model_registries import story, with_clock
from redis_server import redis_server, redis_url  # noqa: F401

from strata.clock import ManualClock
from strata.errors import ConfigError, RegistryError
from strata.registry import (
    InstanceLoad,
    InstanceRecord,
    InstanceState,
    Registry,
    Role,
    create_registry,
)

Make = Callable[[ManualClock], Registry]
TTL_S = 5.0


@pytest.fixture(params=["memory", "sqlite", "redis"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """A factory of registries on ONE shared backend (same file / same server)."""
    if request.param == "memory":
        shared = create_registry("memory://", ttl_s=TTL_S)
        yield lambda clock: with_clock(shared, clock)
        return
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'registry.db'}"
    else:
        url = request.getfixturevalue("redis_url")
        with redis.Redis.from_url(url) as client:
            client.flushdb()
    yield lambda clock: create_registry(url, ttl_s=TTL_S, clock=clock)


def rec(instance_id: str = "i-1", **kw: object) -> InstanceRecord:
    fields: dict[str, object] = {"url": f"http://127.0.0.1:9/{instance_id}", "model": "tiny"}
    return InstanceRecord(instance_id=instance_id, **{**fields, **kw})  # type: ignore[arg-type]


def test_register_get_and_list(make: Make) -> None:
    async def body(reg: Registry, clock: ManualClock) -> None:
        assert await reg.list_instances() == []
        assert await reg.get("i-1") is None
        await reg.register(rec("i-2", role=Role.DECODE, pool="gpu", version="v2"))
        clock.now = 1001.5
        await reg.register(rec("i-1", last_heartbeat=5.0))  # the registry stamps its own clock
        assert await reg.get("i-1") == rec("i-1", last_heartbeat=1001.5)
        assert await reg.list_instances() == [
            rec("i-1", last_heartbeat=1001.5),
            rec("i-2", role=Role.DECODE, pool="gpu", version="v2", last_heartbeat=1000.0),
        ]

    story(make, body)


def test_register_again_replaces_the_record(make: Make) -> None:
    async def body(reg: Registry, clock: ManualClock) -> None:
        await reg.register(rec(state=InstanceState.READY, load=InstanceLoad(num_running=3)))
        await reg.register(rec(url="http://127.0.0.1:10", simulated=True))
        got = await reg.get("i-1")
        assert got == InstanceRecord("i-1", "http://127.0.0.1:10", "tiny", simulated=True,
                                     last_heartbeat=1000.0)
        assert len(await reg.list_instances()) == 1

    story(make, body)


def test_heartbeat_updates_state_load_and_time(make: Make) -> None:
    async def body(reg: Registry, clock: ManualClock) -> None:
        await reg.register(rec())
        clock.now = 1001.0
        load = InstanceLoad(num_running=2, num_waiting=1, kv_usage=0.25, num_in_flight=3)
        await reg.heartbeat("i-1", state=InstanceState.READY, load=load)
        assert await reg.get("i-1") == rec(state=InstanceState.READY, load=load,
                                           last_heartbeat=1001.0)
        clock.now = 1002.0
        await reg.heartbeat("i-1")  # neither given: both kept
        assert await reg.get("i-1") == rec(state=InstanceState.READY, load=load,
                                           last_heartbeat=1002.0)
        await reg.heartbeat("i-1", state=InstanceState.DRAINING)
        got = await reg.get("i-1")
        assert got is not None and (got.state, got.load) == (InstanceState.DRAINING, load)

    story(make, body)


def test_heartbeat_of_an_unknown_instance_raises(make: Make) -> None:
    async def body(reg: Registry, clock: ManualClock) -> None:
        with pytest.raises(RegistryError, match="'ghost' is not registered"):
            await reg.heartbeat("ghost", state=InstanceState.READY)
        assert await reg.list_instances() == []  # and nothing was created

    story(make, body)


def test_deregister_is_idempotent_and_ends_heartbeats(make: Make) -> None:
    async def body(reg: Registry, clock: ManualClock) -> None:
        await reg.register(rec("i-1"))
        await reg.register(rec("i-2"))
        await reg.deregister("i-1")
        await reg.deregister("i-1")
        await reg.deregister("never-there")
        assert [r.instance_id for r in await reg.list_instances()] == ["i-2"]
        with pytest.raises(RegistryError):
            await reg.heartbeat("i-1")  # a deregistered instance is not resurrected

    story(make, body)


def test_expired_record_is_dead_until_its_next_heartbeat(make: Make) -> None:
    async def body(reg: Registry, clock: ManualClock) -> None:
        await reg.register(rec("old", state=InstanceState.READY))
        clock.now = 1000.0 + TTL_S  # exactly ttl old: still alive
        await reg.register(rec("new", state=InstanceState.READY))
        assert [r.state for r in await reg.list_instances()] == [InstanceState.READY] * 2
        clock.now = 1000.0 + TTL_S + 0.5
        states = {r.instance_id: r.state for r in await reg.list_instances()}
        assert states == {"new": InstanceState.READY, "old": InstanceState.DEAD}
        got = await reg.get("old")
        assert got is not None and got.state is InstanceState.DEAD
        await reg.heartbeat("old")
        got = await reg.get("old")
        assert got is not None and (got.state, got.last_heartbeat) == (InstanceState.READY,
                                                                      1005.5)

    story(make, body)


def test_records_round_trip_through_json() -> None:
    record = rec(version="v3", role=Role.PREFILL, pool="fast", state=InstanceState.DRAINING,
                 load=InstanceLoad(4, 5, 0.75, 9), last_heartbeat=12.25, simulated=True)
    text = json.dumps(record.to_json())
    assert InstanceRecord.from_json(json.loads(text)) == record
    assert json.loads(text)["role"] == "prefill" and json.loads(text)["state"] == "draining"
    assert InstanceRecord.from_json({"instance_id": "a", "url": "u", "model": "m"}) == \
        InstanceRecord("a", "u", "m")


def test_a_records_deterministic_flag_round_trips_and_an_older_writers_record_is_not() -> None:
    record = rec(deterministic=True)
    assert json.loads(json.dumps(record.to_json()))["deterministic"] is True
    assert InstanceRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    older = {key: value for key, value in record.to_json().items() if key != "deterministic"}
    assert InstanceRecord.from_json(older).deterministic is False


@pytest.mark.parametrize("make", ["sqlite", "redis"], indirect=True)
def test_two_registry_objects_share_writes(make: Make) -> None:
    async def body(reg: Registry, clock: ManualClock) -> None:
        other = make(clock)  # another handle, as another process would open
        try:
            await reg.register(rec("i-1"))
            await other.register(rec("i-2"))
            await other.heartbeat("i-1", state=InstanceState.READY)
            await reg.deregister("i-2")
            seen = [(r.instance_id, r.state) for r in await other.list_instances()]
            assert seen == [("i-1", InstanceState.READY)]
        finally:
            await other.close()

    story(make, body)


def test_fifty_concurrent_heartbeats_lose_nothing(make: Make) -> None:
    async def body(reg: Registry, clock: ManualClock) -> None:
        ids = [f"i-{n:02d}" for n in range(50)]
        await asyncio.gather(*(reg.register(rec(i)) for i in ids))
        clock.now = 1001.0
        await asyncio.gather(*(reg.heartbeat(i, state=InstanceState.READY,
                                             load=InstanceLoad(num_running=n))
                               for n, i in enumerate(ids)))
        records = await reg.list_instances()
        assert [(r.instance_id, r.state, r.load.num_running, r.last_heartbeat)
                for r in records] == [(i, InstanceState.READY, n, 1001.0)
                                      for n, i in enumerate(ids)]

    story(make, body)


def test_unknown_scheme_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"use one of: memory://, sqlite:///PATH, redis://"):
        create_registry("etcd://127.0.0.1:2379")
    with pytest.raises(ConfigError, match="absolute path"):
        create_registry("sqlite://")
