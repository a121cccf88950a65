"""Version routing stories: explicit versions (404, never another), the live pointer, a canary
split, sessions pinned to their version and moved (flagged) once it retires; per-version stats."""

from __future__ import annotations

import asyncio
import random

import pytest
from gateway_fakes import FakeClock, view

from strata.gateway.instances import InstanceSet
from strata.gateway.requests import RequestParseError, route_request
from strata.gateway.versions import VersionRouter, VersionStats
from strata.registry.model_registry import create_model_registry
from strata.registry.models import ModelRegistry, ModelRouting, ModelVersion
from strata.state.pins import MemoryPinStore


def test_model_at_version_names_a_version_like_the_header() -> None:
    route = route_request(b'{"model": "m@v2"}', {})
    assert (route.model, route.version) == ("m", "v2")
    route = route_request(b'{"model": "m"}', {"x-model-version": "v1"})
    assert (route.model, route.version) == ("m", "v1")
    assert route_request(b'{"model": "m@v1"}', {"x-model-version": "v1"}).version == "v1"
    with pytest.raises(RequestParseError, match="asks for 'v2'"):
        route_request(b'{"model": "m@v1"}', {"x-model-version": "v2"})
    with pytest.raises(RequestParseError, match="NAME@VERSION"):
        route_request(b'{"model": "m@"}', {})


async def _registry(live: str | None = "v1", canary: str | None = None,
                    weight: float = 0.0) -> ModelRegistry:
    models = create_model_registry("memory://")
    for version in ("v1", "v2"):
        await models.add_version(ModelVersion("m", version, f"sim:{version}"))
    if live is not None:
        await models.set_routing(ModelRouting("m", live=live, canary=canary,
                                              canary_weight=weight), expected_revision=0)
    return models


def _router(models: ModelRegistry, instances: InstanceSet, seed: int = 0) -> VersionRouter:
    return VersionRouter(models, instances, MemoryPinStore(), rng=random.Random(seed))


def test_explicit_versions_exist_or_are_404() -> None:
    async def story() -> None:
        instances = InstanceSet([view("a", version="v1")])
        router = _router(await _registry(), instances)
        await router.refresh()
        assert (await router.choose("m", "v2", None)).version == "v2"  # registered
        missing = await router.choose("m", "v9", None)
        assert missing.status_code == 404
        assert "`v9`" in missing.reason and "v1, v2" in missing.reason
        # a model the gateway knows nothing of: the pipeline answers (404 for the model)
        assert (await router.choose("other", "v9", None)).status_code == 200

    asyncio.run(story())


def test_requests_follow_the_live_pointer_and_see_a_flip_on_refresh() -> None:
    async def story() -> None:
        models = await _registry()
        router = _router(models, InstanceSet([view("a", version="v1"), view("b", version="v2")]))
        await router.refresh()
        assert {(await router.choose("m", None, None)).version for _ in range(20)} == {"v1"}
        routing = await models.get_routing("m")
        assert routing is not None
        await models.set_routing(routing.flipped_to("v2"), expected_revision=routing.revision)
        assert (await router.choose("m", None, None)).version == "v1"  # not yet re-read
        await router.refresh()
        choice = await router.choose(None, None, None)  # no model named: the only one
        assert (choice.version, choice.source) == ("v2", "live")

    asyncio.run(story())


def test_a_model_without_routing_is_served_by_any_version() -> None:
    async def story() -> None:
        router = _router(await _registry(live=None), InstanceSet([view("a")]))
        await router.refresh()
        choice = await router.choose("m", None, "s1")
        assert (choice.version, choice.source) == (None, "any")

    asyncio.run(story())


def test_canary_weight_splits_requests_and_whole_sessions() -> None:
    async def story() -> None:
        instances = InstanceSet([view("a", version="v1"), view("b", version="v2")])
        router = _router(await _registry(canary="v2", weight=0.25), instances, seed=7)
        await router.refresh()
        picks = [(await router.choose("m", None, None)).version for _ in range(2000)]
        assert 0.20 < picks.count("v2") / len(picks) < 0.30
        sessions = [f"s{i}" for i in range(400)]
        first = {s: (await router.choose("m", None, s)).version for s in sessions}
        assert 0.17 < list(first.values()).count("v2") / len(sessions) < 0.33
        again = {s: (await router.choose("m", None, s)).version for s in sessions}
        assert again == first  # a session never flips between versions

    asyncio.run(story())


def test_a_session_stays_on_its_version_after_a_flip_and_moves_when_it_retires() -> None:
    async def story() -> None:
        models = await _registry()
        old, new = view("a", version="v1"), view("b", version="v2")
        instances = InstanceSet([old, new])
        router = _router(models, instances)
        await router.refresh()
        assert (await router.choose("m", None, "s1")).version == "v1"
        routing = await models.get_routing("m")
        assert routing is not None
        await models.set_routing(routing.flipped_to("v2"), expected_revision=routing.revision)
        await router.refresh()
        kept = await router.choose("m", None, "s1")
        assert (kept.version, kept.moved_from) == ("v1", None)
        assert (await router.choose("m", None, "s2")).version == "v2"  # new sessions: live
        old.state = "draining"  # v1 retires
        moved = await router.choose("m", None, "s1")
        assert (moved.version, moved.moved_from) == ("v2", "v1")
        again = await router.choose("m", None, "s1")
        assert (again.version, again.moved_from) == ("v2", None)  # flagged once

    asyncio.run(story())


def test_version_stats_window_errors_and_ttft_p99() -> None:
    clock = FakeClock(0.0)
    stats = VersionStats(window_s=10.0, clock=clock)
    for i in range(100):
        stats.record("m", "v2", is_error=i % 10 == 0, ttft_ms=float(i))
    assert stats.summary("m", "v2") == (100, 10, 99.0)
    assert stats.summary("m", "v1") == (0, 0, None)
    clock.advance(11.0)
    stats.record("m", "v2", is_error=False, ttft_ms=5.0)
    assert stats.summary("m", "v2") == (1, 0, 5.0)
