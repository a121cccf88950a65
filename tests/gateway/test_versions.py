"""Version routing stories: explicit versions (404, never another), the live pointer, a canary
split, sessions pinned to their version and moved (flagged) once it retires; per-version stats."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest
from gateway_fakes import FakeClock, FixedSource, Upstreams, json_answer, view

from strata.errors import InvalidRequestError
from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig, RetryConfig
from strata.gateway.path.requests import route_request
from strata.gateway.path.versions import VersionRouter, VersionStats
from strata.gateway.routing.instances import InstanceSet, InstanceView
from strata.registry.models import ModelRegistry, ModelRouting, ModelVersion, create_model_registry
from strata.state.pins import MemoryPinStore


def test_model_at_version_names_a_version_like_the_header() -> None:
    route, _ = route_request(b'{"model": "m@v2"}', {})
    assert (route.model, route.version) == ("m", "v2")
    route, _ = route_request(b'{"model": "m"}', {"x-model-version": "v1"})
    assert (route.model, route.version) == ("m", "v1")
    assert route_request(b'{"model": "m@v1"}', {"x-model-version": "v1"})[0].version == "v1"
    with pytest.raises(InvalidRequestError, match="asks for 'v2'"):
        route_request(b'{"model": "m@v1"}', {"x-model-version": "v2"})
    with pytest.raises(InvalidRequestError, match="NAME@VERSION"):
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


def test_a_flip_or_canary_seen_before_the_new_versions_instances_keeps_the_old_version() -> None:
    """Routing is polled faster than instances: until v2's instance is routable here, a flip to
    v2 keeps requests and new sessions on v1 and a canary on v2 takes none (never a 503)."""
    async def story() -> None:
        models = await _registry(canary="v2", weight=0.5)
        instances = InstanceSet([view("a", version="v1")])
        router = _router(models, instances)
        await router.refresh()
        assert {(await router.choose("m", None, None)).version for _ in range(50)} == {"v1"}
        routing = await models.get_routing("m")
        assert routing is not None
        await models.set_routing(routing.flipped_to("v2"), expected_revision=routing.revision)
        await router.refresh()
        assert (await router.choose("m", None, None)).version == "v1"
        assert (await router.choose("m", None, "s1")).version == "v1"
        instances.add(view("b", version="v2"))  # the instance poll catches up
        assert (await router.choose("m", None, None)).version == "v2"
        assert (await router.choose("m", None, "s2")).version == "v2"

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


def _gateway_app(models: ModelRegistry, upstreams: Upstreams, *views: InstanceView,
                 cache_url: str | None = None) -> Any:
    config = GatewayConfig(policy="round_robin", retry=RetryConfig(max_retries=2,
                                                                   backoff_base_s=0.0),
                           response_cache_url=cache_url)
    return create_gateway_app(config, FixedSource(*views), transport=upstreams.transport(),
                              clock=FakeClock(), run_background=False, models=models)


def _answer(version: str) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        body = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                "system_fingerprint": f"strata-x:m@{version}",
                "choices": [{"index": 0, "text": version, "finish_reason": "length"}]}
        response = json_answer(body)
        response.headers["x-model-version"] = f"m@{version}"
        return response
    return handler


def _draining(request: httpx.Request) -> httpx.Response:
    return json_answer({"error": {"message": "shutting down"}}, 503)


async def _post(app: Any, body: dict[str, Any]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.post("/v1/completions", json=body)


def test_a_flip_this_gateway_has_not_seen_yet_is_read_again_when_the_old_version_refuses() -> None:
    async def story() -> None:
        models = await _registry()
        upstreams = Upstreams(a=_draining, b=_answer("v2"))
        app = _gateway_app(models, upstreams, view("a", version="v1"), view("b", version="v2"))
        gateway = app.state.gateway
        await gateway.versions.refresh()  # sees live = v1
        routing = await models.get_routing("m")
        assert routing is not None
        await models.set_routing(routing.flipped_to("v2"), expected_revision=routing.revision)
        answer = await _post(app, {"model": "m", "prompt": "x"})
        assert answer.status_code == 200
        assert answer.headers["x-model-version"] == "m@v2"
        assert [host for host, _ in upstreams.calls] == ["a", "b"]
        explicit = await _post(app, {"model": "m@v1", "prompt": "x"})
        assert explicit.status_code == 503  # a version the client named: never another

    asyncio.run(story())


def test_the_response_cache_never_answers_for_one_version_with_another() -> None:
    async def story() -> None:
        models = await _registry()
        upstreams = Upstreams(a=_answer("v1"), b=_answer("v2"))
        app = _gateway_app(models, upstreams, view("a", version="v1"), view("b", version="v2"),
                           cache_url="memory://")
        gateway = app.state.gateway
        await gateway.versions.refresh()
        body = {"model": "m", "prompt": "same", "max_tokens": 4, "temperature": 0}
        first, second = await _post(app, body), await _post(app, body)
        assert (first.headers["x-strata-cache"], second.headers["x-strata-cache"]) == (
            "miss", "hit")
        assert second.json()["choices"][0]["text"] == "v1"
        assert second.json()["id"] != first.json()["id"]
        routing = await models.get_routing("m")
        assert routing is not None
        await models.set_routing(routing.flipped_to("v2"), expected_revision=routing.revision)
        await gateway.versions.refresh()
        after = await _post(app, body)
        assert after.headers["x-strata-cache"] == "miss"
        assert after.json()["choices"][0]["text"] == "v2"
        assert (await _post(app, body)).headers["x-strata-cache"] == "hit"
        random_body = body | {"temperature": 0.8}
        assert "x-strata-cache" not in (await _post(app, random_body)).headers
        assert [host for host, _ in upstreams.calls] == ["a", "b", "b"]

    asyncio.run(story())


def test_an_answer_sent_again_to_the_new_version_is_cached_under_the_new_version() -> None:
    """The cache step sits inside the version step: a request sent once more after its version
    was gone passes the cache again, keyed by the version that answers it."""
    async def story() -> None:
        models = await _registry()
        upstreams = Upstreams(a=_draining, b=_answer("v2"))
        app = _gateway_app(models, upstreams, view("a", version="v1"), view("b", version="v2"),
                           cache_url="memory://")
        gateway = app.state.gateway
        await gateway.versions.refresh()  # sees live = v1
        routing = await models.get_routing("m")
        assert routing is not None
        await models.set_routing(routing.flipped_to("v2"), expected_revision=routing.revision)
        body = {"model": "m", "prompt": "same", "max_tokens": 4, "temperature": 0}
        first = await _post(app, body)  # v1 refuses; the registry is read again; v2 answers
        assert (first.headers["x-strata-cache"], first.headers["x-model-version"]) == (
            "miss", "m@v2")
        second = await _post(app, body)  # this gateway now routes to v2: its answer is cached
        assert (second.headers["x-strata-cache"], second.json()["choices"][0]["text"]) == (
            "hit", "v2")
        assert [host for host, _ in upstreams.calls] == ["a", "b"]
        assert (gateway.cache.misses, gateway.cache.stores, gateway.cache.hits) == (2, 1, 1)

    asyncio.run(story())
