"""The ModelRegistry contract on every backend: memory, SQLite (a temp file), Redis (a real
server). Each story runs against one shared backend; sqlite and redis stories may open more
handles on it (separate connections, as separate processes would)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from model_registries import (
    Make,
    full_records,
    make_fixture,  # noqa: F401  (the `make` fixture)
    release,
    story,
)
from redis_server import redis_server, redis_url  # noqa: F401

from strata.clock import ManualClock
from strata.errors import ConfigError, ConflictError
from strata.registry.models import (
    Deployment,
    DeploymentState,
    ModelRegistry,
    ModelRouting,
    ModelVersion,
    Release,
    ReleaseState,
)
from strata.registry.releases.health import HEALTH_RETENTION_S, HealthWindow

# --- versions ---------------------------------------------------------------------------------


def test_versions_add_get_and_list_sorted(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
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
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
        first = await reg.add_version(ModelVersion("chat", "v1", "/m/1", "cd" * 32))
        clock.now = 2000.0
        assert await reg.add_version(ModelVersion("chat", "v1", "/m/1", "cd" * 32)) == first
        for changed in ({"uri": "/m/other"}, {"manifest_sha256": "ef" * 32},
                        {"serve_args": ("--max-num-seqs", "4")}, {"base": "other"}):
            with pytest.raises(ConflictError, match="chat@v1 is already registered"):
                await reg.add_version(replace(first, **changed))  # type: ignore[arg-type]
        assert await reg.list_versions() == [first]

    story(make, body)


def test_an_adapter_version_keeps_its_base(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
        adapter = await reg.add_version(ModelVersion("sql", "v1", "/a/sql", "ab" * 32,
                                                     base="chat"))
        assert adapter.is_adapter and adapter.base == "chat"
        assert await reg.get_version("sql", "v1") == adapter
        assert await reg.list_versions("sql") == [adapter]
        assert not (await reg.add_version(ModelVersion("chat", "v1", "/m/1"))).is_adapter

    story(make, body)


# --- routing ----------------------------------------------------------------------------------


def test_routing_is_compare_and_set(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
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
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
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
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
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
        # a launcher deleting what it read as retiring loses to a re-activation since
        assert await reg.delete_deployment("chat", "v2", expected_revision=1) is False
        assert await reg.delete_deployment("chat", "v2", expected_revision=2) is True
        assert await reg.delete_deployment("chat", "v2") is False  # idempotent
        assert await reg.delete_deployment("ghost", "v0") is False
        assert await reg.delete_deployment("a", "z") is True
        assert [x.key for x in await reg.list_deployments()] == ["chat@v1"]
        again = await reg.put_deployment(Deployment("chat", "v2", 3), expected_revision=0)
        assert again.revision == 1  # deleted means absent: created anew

    story(make, body)


# --- releases ---------------------------------------------------------------------------------


def test_releases_cas_and_sorted_list(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
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
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
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
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
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


def test_prune_keeps_the_newest_finished_releases_and_the_one_in_progress(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
        for n in range(5):  # r-0 .. r-4, finished in order
            clock.now = 1000.0 + n
            stored = await reg.put_release(release(f"r-{n}"), expected_revision=0)
            await reg.put_release(stored.moved_to(ReleaseState.DONE, clock.now),
                                  expected_revision=1)
        running = await reg.put_release(release("r-5"), expected_revision=0)
        other = await reg.put_release(release("e-0", name="embed", state=ReleaseState.DONE),
                                      expected_revision=0)
        assert await reg.prune_releases("chat", keep=2) == 3
        assert [r.release_id for r in await reg.list_releases("chat")] == ["r-3", "r-4", "r-5"]
        assert await reg.prune_releases("chat", keep=2) == 0
        assert await reg.prune_releases("chat", keep=0) == 2
        assert await reg.list_releases() == [other, running]  # another model, in progress
        assert await reg.get_release("r-0") is None
        with pytest.raises(ConflictError, match="'chat' already has a release in progress"):
            await reg.put_release(release("r-6"), expected_revision=0)  # r-5 still counts

    story(make, body)


# --- health windows ---------------------------------------------------------------------------


def test_health_windows_upsert_per_gateway_and_age_out(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
        b = await reg.put_health(HealthWindow("gw-b", "chat", "v2", 10, 3, ((40, 7),)))
        assert b == HealthWindow("gw-b", "chat", "v2", 10, 3, ((40, 7),), published_at=1000.0)
        clock.now = 1001.0
        a = await reg.put_health(HealthWindow("gw-a", "chat", "v2", 4, 0, ((30, 1), (41, 3))))
        live = await reg.put_health(HealthWindow("gw-a", "chat", "v1", 50, 0, ((20, 50),)))
        assert await reg.list_health("chat", "v2") == [a, b]  # by gateway
        assert await reg.list_health("chat", "v1") == [live]
        assert await reg.list_health("chat", "v9") == []
        clock.now = 1002.0
        b2 = await reg.put_health(HealthWindow("gw-b", "chat", "v2", 12, 3, ((40, 9),)))
        assert await reg.list_health("chat", "v2") == [a, b2]  # replaced, not added
        clock.now = 1001.0 + HEALTH_RETENTION_S + 1  # gw-a stopped publishing
        b3 = await reg.put_health(HealthWindow("gw-b", "chat", "v2", 1, 0, ()))
        assert await reg.list_health("chat", "v2") == [b3]
        assert await reg.list_health("chat", "v1") == []

    story(make, body)


# --- JSON and lifetime ------------------------------------------------------------------------


def test_every_record_round_trips_through_json() -> None:
    window = HealthWindow("gw-1", "chat", "v3", 9, 2, ((0, 1), (57, 6)), published_at=3.5)
    for record in (*full_records(), window):
        text = json.dumps(record.to_json())
        assert type(record).from_json(json.loads(text)) == record


def test_records_read_back_whole_from_another_handle(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
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
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
        await reg.add_version(ModelVersion("chat", "v1", "/m/1"))
        await reg.close()
        await reg.close()  # raises nothing
        other = make(clock)  # memory: the same object; sqlite/redis: a new connection
        try:
            assert [v.key for v in await other.list_versions()] == ["chat@v1"]  # nothing lost
        finally:
            await other.close()

    story(make, body)  # story closes it a third time
