"""The ModelRegistry contract on every backend: memory, SQLite (a temp file), Redis (a real
server). Each story runs against one shared backend; sqlite and redis stories may open more
handles on it (separate connections, as separate processes would)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from redis_server import free_port, redis_server, redis_url  # noqa: F401

from strata.errors import ConfigError
from strata.registry import InstanceRecord, RegistryError, create_registry
from strata.registry.model_registry import create_model_registry
from strata.registry.models import (
    ConflictError,
    Deployment,
    DeploymentState,
    ModelRegistry,
    ModelRouting,
    ModelVersion,
    Release,
    ReleaseState,
    Strategy,
)

BACKENDS = ["memory", "sqlite", "redis"]


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


Make = Callable[[FakeClock], ModelRegistry]


@pytest.fixture(params=BACKENDS)
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """A factory of registries on ONE shared backend (same object / file / server)."""
    if request.param == "memory":
        shared = create_model_registry("memory://")
        yield lambda clock: _with_clock(shared, clock)
        return
    url = backend_url(request, tmp_path)
    yield lambda clock: create_model_registry(url, clock=clock)


def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    import redis

    url: str = request.getfixturevalue("redis_url")
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    return url


def _with_clock(registry: ModelRegistry, clock: FakeClock) -> ModelRegistry:
    registry.clock = clock  # type: ignore[attr-defined]
    return registry


def story(make: Make, body: Callable[[ModelRegistry, FakeClock], Awaitable[None]]) -> None:
    async def main() -> None:
        clock = FakeClock()
        registry = make(clock)
        try:
            await body(registry, clock)
        finally:
            await registry.close()

    asyncio.run(main())


def release(release_id: str = "r-1", name: str = "chat", **kw: Any) -> Release:
    return Release(release_id=release_id, name=name, to_version="v2", from_version="v1", **kw)


# --- versions ---------------------------------------------------------------------------------


def test_versions_add_get_and_list_sorted(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: FakeClock) -> None:
        assert await reg.list_versions() == []
        v2 = await reg.add_version(ModelVersion("chat", "v2", "/models/chat-2", "ab" * 32))
        assert v2 == ModelVersion("chat", "v2", "/models/chat-2", "ab" * 32, created_at=1000.0)
        clock.now = 1001.0
        v1 = await reg.add_version(ModelVersion("chat", "v1", "sim:tiny", serve_args=("--x",)))
        old = await reg.add_version(ModelVersion("chat", "v0", "/m/0", created_at=5.0))
        emb = await reg.add_version(ModelVersion("embed", "a", "s3://bucket/embed"))
        assert old.created_at == 5.0  # a caller's created_at is kept
        assert await reg.list_versions() == [old, v2, v1, emb]  # by (name, created_at, version)
        assert await reg.list_versions("chat") == [old, v2, v1]
        assert await reg.list_versions("nope") == []
        assert await reg.get_version("chat", "v1") == v1
        assert await reg.get_version("chat", "v9") is None

    story(make, body)


def test_re_adding_a_version_is_a_no_op_unless_it_differs(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: FakeClock) -> None:
        first = await reg.add_version(ModelVersion("chat", "v1", "/m/1", "cd" * 32))
        clock.now = 2000.0
        assert await reg.add_version(ModelVersion("chat", "v1", "/m/1", "cd" * 32)) == first
        for changed in ({"uri": "/m/other"}, {"manifest_sha256": "ef" * 32},
                        {"serve_args": ("--max-num-seqs", "4")}):
            with pytest.raises(ConflictError, match="chat@v1 is already registered"):
                await reg.add_version(replace(first, **changed))  # type: ignore[arg-type]
        assert await reg.list_versions() == [first]

    story(make, body)


# --- routing ----------------------------------------------------------------------------------


def test_routing_is_compare_and_set(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: FakeClock) -> None:
        assert await reg.get_routing("chat") is None
        created = await reg.set_routing(ModelRouting("chat", live="v1"), expected_revision=0)
        assert created == ModelRouting("chat", live="v1", revision=1, updated_at=1000.0)
        with pytest.raises(ConflictError, match="'chat' already exists"):
            await reg.set_routing(ModelRouting("chat", live="v9"), expected_revision=0)
        clock.now = 1002.5
        flipped = await reg.set_routing(created.flipped_to("v2"), expected_revision=1)
        assert flipped == ModelRouting("chat", live="v2", previous="v1", revision=2,
                                       updated_at=1002.5)
        with pytest.raises(ConflictError, match="at revision 2, not 1"):
            await reg.set_routing(created.flipped_to("v3"), expected_revision=1)
        with pytest.raises(ConflictError, match="'embed' does not exist"):
            await reg.set_routing(ModelRouting("embed", live="a"), expected_revision=4)
        with pytest.raises(ConfigError, match="expected_revision must be >= 0"):
            await reg.set_routing(ModelRouting("embed", live="a"), expected_revision=-1)
        canary = replace(flipped, canary="v3", canary_weight=0.25)
        await reg.set_routing(canary, expected_revision=2)
        await reg.set_routing(ModelRouting("a-model", live="x"), expected_revision=0)
        assert [(r.name, r.revision) for r in await reg.list_routing()] == [("a-model", 1),
                                                                           ("chat", 3)]
        assert await reg.get_routing("chat") == replace(canary, revision=3)

    story(make, body)


def test_racing_routing_writers_exactly_one_wins(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: FakeClock) -> None:
        read = await reg.set_routing(ModelRouting("chat", live="v1"), expected_revision=0)
        writers = [reg] + [make(clock) for _ in range(9)]  # separate connections where shared
        try:
            results = await asyncio.gather(
                *(w.set_routing(read.flipped_to(f"v{n + 2}"), expected_revision=read.revision)
                  for n, w in enumerate(writers)), return_exceptions=True)
        finally:
            await asyncio.gather(*(w.close() for w in writers[1:] if w is not reg))
        winners = [r for r in results if isinstance(r, ModelRouting)]
        assert len(winners) == 1, results
        assert all(isinstance(r, ConflictError) for r in results if r is not winners[0])
        assert await reg.get_routing("chat") == winners[0]
        assert winners[0].revision == 2 and winners[0].previous == "v1"

    story(make, body)


# --- deployments ------------------------------------------------------------------------------


def test_deployments_cas_delete_and_sorted_list(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: FakeClock) -> None:
        d = await reg.put_deployment(Deployment("chat", "v2", replicas=2), expected_revision=0)
        assert d == Deployment("chat", "v2", 2, revision=1, updated_at=1000.0)
        with pytest.raises(ConflictError, match="'chat@v2' already exists"):
            await reg.put_deployment(Deployment("chat", "v2", replicas=5), expected_revision=0)
        await reg.put_deployment(Deployment("chat", "v1", replicas=1), expected_revision=0)
        await reg.put_deployment(Deployment("a", "z", replicas=0), expected_revision=0)
        clock.now = 1003.0
        retiring = replace(d, state=DeploymentState.RETIRING)
        assert await reg.put_deployment(retiring, expected_revision=1) == replace(
            retiring, revision=2, updated_at=1003.0)
        with pytest.raises(ConflictError, match="at revision 2, not 1"):
            await reg.put_deployment(d, expected_revision=1)
        assert [x.key for x in await reg.list_deployments()] == ["a@z", "chat@v1", "chat@v2"]
        await reg.delete_deployment("chat", "v2")
        await reg.delete_deployment("chat", "v2")  # idempotent
        await reg.delete_deployment("ghost", "v0")
        assert [x.key for x in await reg.list_deployments()] == ["a@z", "chat@v1"]
        again = await reg.put_deployment(Deployment("chat", "v2", 3), expected_revision=0)
        assert again.revision == 1  # deleted means absent: created anew

    story(make, body)


# --- releases ---------------------------------------------------------------------------------


def test_releases_cas_and_sorted_list(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: FakeClock) -> None:
        r1 = await reg.put_release(release("r-b"), expected_revision=0)
        assert r1 == release("r-b", revision=1, created_at=1000.0, updated_at=1000.0)
        clock.now = 1001.0
        started = r1.moved_to(ReleaseState.STARTING, 1000.5)
        stored = await reg.put_release(started, expected_revision=1)
        assert stored == replace(started, revision=2, updated_at=1001.0)  # created_at kept
        with pytest.raises(ConflictError, match="'r-b' is at revision 2, not 1"):
            await reg.put_release(r1.moved_to(ReleaseState.WARMING, 1001.0), expected_revision=1)
        with pytest.raises(ConflictError, match="'r-b' already exists"):
            await reg.put_release(release("r-b"), expected_revision=0)
        other = await reg.put_release(release("r-a", name="embed"), expected_revision=0)
        early = await reg.put_release(release("r-c", name="x", created_at=10.0),
                                      expected_revision=0)
        assert await reg.get_release("r-b") == stored
        assert await reg.get_release("r-zz") is None
        assert await reg.list_releases() == [early, stored, other]  # (created_at, release_id)
        assert await reg.list_releases("embed") == [other]

    story(make, body)


def test_one_release_in_progress_per_model(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: FakeClock) -> None:
        first = await reg.put_release(release("r-1"), expected_revision=0)
        with pytest.raises(ConflictError, match="'chat' already has a release in progress"):
            await reg.put_release(release("r-2"), expected_revision=0)
        await reg.put_release(release("r-3", name="embed"), expected_revision=0)
        assert await reg.get_release("r-2") is None
        done = first.moved_to(ReleaseState.ROLLING_BACK, 1000.0).moved_to(
            ReleaseState.ROLLED_BACK, 1000.0, reason="warm-up failed")
        await reg.put_release(done, expected_revision=1)
        second = await reg.put_release(release("r-2"), expected_revision=0)
        assert second.state is ReleaseState.PENDING
        with pytest.raises(ConflictError, match="already has a release in progress"):
            await reg.put_release(replace(done, state=ReleaseState.PENDING), expected_revision=2)

    story(make, body)


def test_racing_release_creators_exactly_one_wins(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: FakeClock) -> None:
        writers = [reg] + [make(clock) for _ in range(5)]
        try:
            results = await asyncio.gather(
                *(w.put_release(release(f"r-{n}"), expected_revision=0)
                  for n, w in enumerate(writers)), return_exceptions=True)
        finally:
            await asyncio.gather(*(w.close() for w in writers[1:] if w is not reg))
        winners = [r for r in results if isinstance(r, Release)]
        assert len(winners) == 1, results
        assert all(isinstance(r, ConflictError) for r in results if r is not winners[0])
        assert await reg.list_releases() == winners

    story(make, body)


# --- JSON and lifetime ------------------------------------------------------------------------


def full_records() -> tuple[ModelVersion, ModelRouting, Deployment, Release]:
    return (ModelVersion("chat", "v2", "file:///m/2", "12" * 32, ("--a", "b"), 7.25),
            ModelRouting("chat", "v2", "v1", "v3", 0.125),
            Deployment("chat", "v3", 4, DeploymentState.RETIRING),
            Release("r-9", "chat", "v3", None, Strategy.CANARY, 0.2, 3, ReleaseState.CANARY,
                    "watching", (("pending", 1.5), ("canary", 2.75)), "ctl-1", 99.5,
                    created_at=1.25, stats={"ready_to_flip_s": 0.5}))


def test_every_record_round_trips_through_json() -> None:
    for record in full_records():
        text = json.dumps(record.to_json())
        assert type(record).from_json(json.loads(text)) == record


def test_records_read_back_whole_from_another_handle(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: FakeClock) -> None:
        version, routing, deployment, rel = full_records()
        stored = (await reg.add_version(version),
                  await reg.set_routing(routing, expected_revision=0),
                  await reg.put_deployment(deployment, expected_revision=0),
                  await reg.put_release(rel, expected_revision=0))
        await reg.close()
        other = make(clock)  # memory: the same object; sqlite/redis: a new connection
        try:
            assert (await other.get_version("chat", "v2"), await other.get_routing("chat"),
                    (await other.list_deployments())[0], await other.get_release("r-9")) == stored
        finally:
            await other.close()
        assert stored[3].stats == {"ready_to_flip_s": 0.5} and stored[3].from_version is None

    story(make, body)


def test_close_twice_is_harmless(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: FakeClock) -> None:
        await reg.add_version(ModelVersion("chat", "v1", "/m/1"))
        await reg.close()

    story(make, body)  # story closes it a second time


def test_memory_urls_give_fresh_registries_and_bad_urls_say_what_to_use() -> None:
    async def main() -> None:
        a, b = create_model_registry("memory://"), create_model_registry("memory://")
        await a.add_version(ModelVersion("chat", "v1", "/m/1"))
        assert await b.list_versions() == []

    asyncio.run(main())
    with pytest.raises(ConfigError, match="use one of: memory://, sqlite:///PATH, redis://"):
        create_model_registry("etcd://127.0.0.1")
    with pytest.raises(ConfigError, match="needs an absolute path"):
        create_model_registry("sqlite://relative.db")


# --- many processes ---------------------------------------------------------------------------

_INCREMENTS = """
import asyncio, sys
from strata.registry.model_registry import create_model_registry
from strata.registry.models import ConflictError

async def main(url: str, count: int) -> None:
    reg = create_model_registry(url)
    retries = 0
    for _ in range(count):
        while True:
            d = next(x for x in await reg.list_deployments() if x.key == "chat@v1")
            try:
                await reg.put_deployment(d.__class__(d.name, d.version, d.replicas + 1),
                                         expected_revision=d.revision)
                break
            except ConflictError:
                retries += 1
    await reg.close()
    print(retries)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


@pytest.mark.parametrize("make", ["sqlite", "redis"], indirect=True)
def test_two_processes_incrementing_by_cas_lose_no_update(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: FakeClock) -> None:
        await reg.put_deployment(Deployment("chat", "v1", 0), expected_revision=0)
        url = reg_url(reg)
        procs = [await asyncio.create_subprocess_exec(
            sys.executable, "-c", _INCREMENTS, url, "100", stdout=asyncio.subprocess.PIPE)
            for _ in range(2)]
        outputs = [await p.communicate() for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        (final,) = await reg.list_deployments()
        assert (final.replicas, final.revision) == (200, 201)  # every increment landed once

    story(make, body)


def reg_url(reg: ModelRegistry) -> str:
    path = getattr(reg, "path", None)
    return f"sqlite:///{path}" if path is not None else str(reg.url)  # type: ignore[attr-defined]


def test_sqlite_shares_the_instance_registry_file_and_stores_json(tmp_path: Path) -> None:
    path = tmp_path / "registry.db"

    async def main() -> None:
        instances = create_registry(f"sqlite:///{path}")
        models = create_model_registry(f"sqlite:///{path}", clock=FakeClock())
        try:
            await instances.register(InstanceRecord("i-1", "http://127.0.0.1:9", "chat"))
            stored = await models.put_release(full_records()[3], expected_revision=0)
            assert [r.instance_id for r in await instances.list_instances()] == ["i-1"]
        finally:
            await instances.close()
            await models.close()
        with closing(sqlite3.connect(path)) as conn:
            (text,) = conn.execute("SELECT record FROM releases").fetchone()
        assert json.loads(text) == stored.to_json()

    asyncio.run(main())


def test_redis_failures_are_registry_errors_naming_the_url() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there

    async def main() -> None:
        reg = create_model_registry(url)
        try:
            with pytest.raises(RegistryError, match=f"redis model registry {url}"):
                await reg.set_routing(ModelRouting("chat", live="v1"), expected_revision=0)
            with pytest.raises(RegistryError, match=f"redis model registry {url}"):
                await reg.list_versions()
        finally:
            await reg.close()

    asyncio.run(main())
