"""A canary is judged on every gateway's traffic: each gateway publishes its window of the canary
and live versions to the registry, and the driving gateway adds them to its own.

The story at the end: gateway A drives a canary release but none of its requests goes to the
canary; gateway B's do, and fail. Pooled through the registry, B's failures roll the canary
back; judged on A's traffic alone (the old way), it would have been promoted.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import pytest
from registry.release_world import CONFIG, World, states

from strata.clock import ManualClock
from strata.gateway.config import VersionConfig
from strata.gateway.control.releases import HealthPublisher, PooledHealth
from strata.gateway.path.versions import VersionRouter, VersionStats
from strata.gateway.routing.instances import InstanceSet
from strata.registry.models import (
    ModelRegistry,
    ModelRouting,
    ModelVersion,
    Strategy,
    create_model_registry,
)
from strata.registry.releases.health import (
    BUCKETS_PER_DOUBLING,
    HealthWindow,
    bucket_upper_ms,
    pooled,
    ttft_bucket,
    window_of,
)
from strata.registry.releases.policy import VersionHealth


def test_buckets_hold_their_values_and_are_nine_percent_wide() -> None:
    for ttft_ms in (0.05, 0.1, 0.11, 1.0, 7.3, 100.0, 100.1, 12_345.0):
        bucket = ttft_bucket(ttft_ms)
        assert ttft_ms <= bucket_upper_ms(bucket)
        assert bucket == 0 or ttft_ms > bucket_upper_ms(bucket - 1)
    assert bucket_upper_ms(8) / bucket_upper_ms(7) == pytest.approx(2 ** (1 / 8))
    assert BUCKETS_PER_DOUBLING == 8


def test_pooled_p99_is_the_upper_bound_of_the_exact_p99s_bucket() -> None:
    rng = random.Random(3)
    for n in (1, 7, 100, 1000):
        ttfts = [rng.lognormvariate(4.0, 1.0) for _ in range(n)]
        exact = sorted(ttfts)[min(n - 1, int(0.99 * n))]  # how the controller always took it
        health = pooled([window_of("g", "m", "v", [(False, t) for t in ttfts])])
        assert health.ttft_p99_ms == bucket_upper_ms(ttft_bucket(exact))
        assert exact <= health.ttft_p99_ms < exact * 2 ** (1 / BUCKETS_PER_DOUBLING)


def test_windows_of_several_gateways_add_up_to_the_window_of_all_their_requests() -> None:
    rng = random.Random(5)
    outcomes = [(rng.random() < 0.1, None if rng.random() < 0.1 else rng.uniform(5, 900))
                for _ in range(300)]
    parts = [window_of(f"g{i}", "m", "v", outcomes[i::3]) for i in range(3)]
    whole = window_of("all", "m", "v", outcomes)
    assert pooled(parts) == pooled([whole])
    errors = sum(e for e, _ in outcomes)
    assert pooled(parts).num_requests == 300 and pooled(parts).num_errors == errors
    assert pooled([]) == VersionHealth(0, 0, None)


async def _models(canary: str | None, clock: ManualClock) -> ModelRegistry:
    models = create_model_registry("memory://", clock=clock)
    for version in ("v1", "v2"):
        await models.add_version(ModelVersion("m", version, f"sim:{version}"))
    await models.set_routing(ModelRouting("m", live="v1", canary=canary, canary_weight=0.5),
                             expected_revision=0)
    await models.add_version(ModelVersion("quiet", "v1", "sim:v1"))
    await models.set_routing(ModelRouting("quiet", live="v1"), expected_revision=0)
    return models


def _gateway(name: str, models: ModelRegistry,
             clock: ManualClock) -> tuple[VersionStats, HealthPublisher]:
    stats = VersionStats(clock=clock)
    router = VersionRouter(models, InstanceSet([]), None)
    return stats, HealthPublisher(models, stats, router, gateway=name)


def test_pooled_health_adds_the_windows_other_gateways_published_recently() -> None:
    async def story() -> None:
        clock = ManualClock(1000.0)
        models = await _models("v2", clock)
        stats_a, publisher_a = _gateway("gw-a", models, clock)
        stats_b, publisher_b = _gateway("gw-b", models, clock)
        for publisher in (publisher_a, publisher_b):
            await publisher.router.refresh()
        for i in range(30):
            stats_b.record("m", "v2", is_error=i < 20, ttft_ms=None if i < 20 else 50.0)
        stats_a.record("m", "v2", is_error=False, ttft_ms=400.0)
        await publisher_b.publish_once()
        await publisher_a.publish_once()  # a's own window is in the registry too
        health = PooledHealth(models, stats_a, gateway="gw-a", max_age_s=5.0, clock=clock)
        stats_a.record("m", "v2", is_error=True)  # not published yet: read from a itself
        expected = VersionHealth(32, 21, bucket_upper_ms(ttft_bucket(400.0)))
        assert await health("m", "v2") == expected  # a counted once, b added
        assert await health("m", "v1") == VersionHealth(0, 0, None)
        clock.advance(6.0)  # b stopped publishing: its window is too old to count
        assert await health("m", "v2") == VersionHealth(2, 1, expected.ttft_p99_ms)

    asyncio.run(story())


def test_a_gateway_publishes_the_canary_and_live_windows_of_models_with_a_canary() -> None:
    async def story() -> None:
        clock = ManualClock(1000.0)
        models = await _models(None, clock)
        stats, publisher = _gateway("gw-b", models, clock)
        await publisher.router.refresh()
        for model, version in (("m", "v1"), ("m", "v2"), ("quiet", "v1")):
            stats.record(model, version, is_error=False, ttft_ms=10.0)
        await publisher.publish_once()
        assert await models.list_health("m", "v1") == []  # no canary: nothing to judge
        routing = await models.get_routing("m")
        assert routing is not None
        await models.set_routing(ModelRouting("m", live="v1", canary="v2", canary_weight=0.5),
                                 expected_revision=routing.revision)
        await publisher.router.refresh()
        await publisher.publish_once()
        published = [w for v in ("v1", "v2") for w in await models.list_health("m", v)]
        assert [(w.gateway, w.key, w.num_requests) for w in published] == [
            ("gw-b", "m@v1", 1), ("gw-b", "m@v2", 1)]
        assert await models.list_health("quiet", "v1") == []

    asyncio.run(story())


@pytest.mark.parametrize("is_pooled", [True, False], ids=["pooled", "driver-only"])
def test_a_canary_failing_only_on_another_gateway_is_rolled_back(is_pooled: bool) -> None:
    async def story() -> None:
        world = await World.create()
        clock = world.clock
        stats_a, stats_b = VersionStats(clock=clock), VersionStats(clock=clock)
        router_b = VersionRouter(world.models, InstanceSet([]), None)
        publisher_b = HealthPublisher(world.models, stats_b, router_b, gateway="gw-b")
        sleep: Callable[[float], Awaitable[None]] = world.sleep

        async def traffic_then_sleep(seconds: float) -> None:
            """Each poll: a's requests all go to live; b's canary requests fail."""
            await sleep(seconds)
            stats_a.record("m", "v1", is_error=False, ttft_ms=100.0)
            await router_b.refresh()
            routing = router_b.routing["m"]
            assert routing.live is not None
            stats_b.record("m", routing.live, is_error=False, ttft_ms=100.0)
            if routing.canary is not None:
                for _ in range(2):
                    stats_b.record("m", routing.canary, is_error=True)
            if is_pooled:
                await publisher_b.publish_once()

        world.sleep = traffic_then_sleep  # type: ignore[method-assign]
        health = PooledHealth(world.models, stats_a, gateway="gw-a", max_age_s=5.0,
                              clock=clock)
        driver = world.controller("gw-a", health=health)
        release = await driver.start("m", "v2", strategy=Strategy.CANARY, canary_weight=0.25)
        final = await driver.drive(release.release_id)
        assert stats_a.summary("m", "v2") == (0, 0, None)  # the driver never saw the canary
        if is_pooled:
            assert states(final) == ["pending", "starting", "warming", "canary",
                                     "rolling_back", "rolled_back"]
            assert final.reason.startswith("canary m@v2: error rate 100.0% (20 of 20 requests)")
            assert await world.routing() == ("v1", None, None)
        else:
            assert states(final)[-3:] == ["flipping", "retiring", "done"]  # promoted, wrongly

    asyncio.run(story())


@pytest.mark.parametrize("window_s", [None, 60.0], ids=["canary-window", "60s"])
def test_a_slow_canary_is_compared_with_live_over_the_same_period(window_s: float | None) -> None:
    """Live was slow before the canary began (its instances started on the same machine); over
    the canary's window live is fast again and the canary is not: compared over that window
    the canary rolls back; against a 60 s live p99 it would have passed."""
    async def story() -> None:
        world = await World.create()
        config = VersionConfig(release=CONFIG)
        assert config.health_window_s == CONFIG.canary_window_s
        stats = VersionStats(window_s or config.health_window_s, clock=world.clock)
        for _ in range(50):
            stats.record("m", "v1", is_error=False, ttft_ms=800.0)
        sleep: Callable[[float], Awaitable[None]] = world.sleep

        async def traffic_then_sleep(seconds: float) -> None:
            await sleep(seconds)
            routing = await world.models.get_routing("m")
            assert routing is not None and routing.live is not None
            for _ in range(5):
                stats.record("m", routing.live, is_error=False, ttft_ms=100.0)
            for _ in range(2 if routing.canary is not None else 0):
                stats.record("m", routing.canary, is_error=False, ttft_ms=500.0)

        world.sleep = traffic_then_sleep  # type: ignore[method-assign]
        health = PooledHealth(world.models, stats, gateway="gw-a", max_age_s=5.0,
                              clock=world.clock)
        driver = world.controller("gw-a", health=health)
        release = await driver.start("m", "v2", strategy=Strategy.CANARY, canary_weight=0.25)
        final = await driver.drive(release.release_id)
        if window_s is None:
            assert states(final)[-2:] == ["rolling_back", "rolled_back"]
            assert final.reason.startswith("canary m@v2: TTFT p99"), final.reason
        else:
            assert states(final)[-3:] == ["flipping", "retiring", "done"]  # promoted, wrongly

    asyncio.run(story())


def test_health_window_json_keeps_the_histogram() -> None:
    window = window_of("gw", "m", "v", [(False, 12.0), (False, 12.5), (True, None)])
    assert HealthWindow.from_json(window.to_json()) == window
    assert window.ttft_counts == ((ttft_bucket(12.0), 2),)
