"""Outlier ejection and active health checks, on a fake clock."""

from __future__ import annotations

import asyncio

import httpx
from gateway_fakes import FakeClock, Upstreams, json_answer, view

from strata.gateway.config import EjectionConfig
from strata.gateway.routing.health import HealthChecker, OutlierDetector
from strata.gateway.routing.instances import InstanceSet, InstanceView

CONFIG = EjectionConfig(consecutive_failures=3, base_ejection_s=2.0, max_ejection_s=10.0,
                        max_ejected_fraction=0.5)


def detector(*views: InstanceView, clock: FakeClock) -> OutlierDetector:
    ejected: list[str] = []
    d = OutlierDetector(InstanceSet(views), CONFIG, clock,
                        on_eject=lambda v: ejected.append(v.instance_id))
    d.ejected = ejected  # type: ignore[attr-defined]
    return d


def test_ejected_after_n_consecutive_failures_and_a_success_resets_the_count() -> None:
    clock = FakeClock()
    a, b = view("a"), view("b")
    d = detector(a, b, clock=clock)
    assert [d.record_failure(a), d.record_failure(a)] == [False, False]
    d.record_success(a)
    assert [d.record_failure(a), d.record_failure(a), d.record_failure(a)] == [False, False, True]
    assert a.is_ejected and not a.is_routable
    assert a.ejected_until == 1002.0
    assert d.ejected == ["a"]  # type: ignore[attr-defined]


def test_rejoins_only_after_its_time_and_a_passing_check_with_doubling_backoff() -> None:
    clock = FakeClock()
    a, b = view("a"), view("b")
    d = detector(a, b, clock=clock)
    durations = []
    for _ in range(4):
        start = clock.now
        for _ in range(3):
            d.record_failure(a)
        durations.append(a.ejected_until - start)
        clock.advance(1.0)
        d.record_health(a, True)  # too early: still ejected
        assert a.is_ejected
        clock.now = a.ejected_until
        d.record_health(a, False)  # time is up but the check fails: still ejected
        assert a.is_ejected
        d.record_health(a, True)
        assert not a.is_ejected and a.is_routable and a.consecutive_failures == 0
    assert durations == [2.0, 4.0, 8.0, 10.0]  # doubling, capped at max_ejection_s


def test_passing_checks_forgive_earlier_ejections_one_at_a_time() -> None:
    clock = FakeClock()
    a, b = view("a"), view("b")
    d = detector(a, b, clock=clock)
    a.num_ejections = 2
    d.record_health(a, True)
    assert a.num_ejections == 1
    assert d.ejection_s(a.num_ejections) == 4.0


def test_never_more_than_the_max_fraction_is_ejected() -> None:
    clock = FakeClock()
    views = [view(name) for name in "abcd"]
    d = detector(*views, clock=clock)
    for v in views:
        for _ in range(3):
            d.record_failure(v)
    assert [v.is_ejected for v in views] == [True, True, False, False]  # 0.5 of 4
    assert views[2].consecutive_failures == 3  # still counted
    clock.now = views[0].ejected_until
    d.record_health(views[0], True)  # one rejoins: room for one more
    d.record_failure(views[2])
    assert [v.is_ejected for v in views] == [False, True, True, False]


def test_a_lone_instance_is_never_ejected() -> None:
    a = view("a")
    d = detector(a, clock=FakeClock())
    for _ in range(10):
        d.record_failure(a)
    assert not a.is_ejected


def test_health_checker_probes_every_instance_and_failures_eject() -> None:
    clock = FakeClock()
    a, b, c = view("a"), view("b"), view("c")
    upstreams = Upstreams(a=lambda r: json_answer({"status": "ok"}),
                          b=lambda r: json_answer({"error": "dead"}, 503))  # c refuses
    instances = InstanceSet([a, b, c])
    d = OutlierDetector(instances, EjectionConfig(max_ejected_fraction=1.0), clock)

    async def story() -> None:
        async with httpx.AsyncClient(transport=upstreams.transport()) as client:
            checker = HealthChecker(instances, d, client, timeout_s=1.0)
            for _ in range(3):
                await checker.check_once()

    asyncio.run(story())
    assert sorted(upstreams.calls) == sorted([(h, "/health") for h in "abc"] * 3)
    assert (a.is_healthy, b.is_healthy, c.is_healthy) == (True, False, False)
    assert (a.is_ejected, b.is_ejected, c.is_ejected) == (False, True, True)
