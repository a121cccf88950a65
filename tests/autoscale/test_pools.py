"""Pools scale separately (strata/autoscale/controller.py over a pooled deployment): each pool
its own capacity (its role's), signals, dwell and bounds. Stories on a virtual clock: rounds
every `interval_s` over a registry in memory, each pool's traffic a rate function of time."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from gateway_fakes import FixedSource, view

from strata.autoscale.capacity import CapacityModel
from strata.autoscale.config import AutoscaleConfig
from strata.autoscale.controller import Autoscaler
from strata.autoscale.gateway_link import GatewayAutoscaler
from strata.autoscale.law import ScalingLaw, Signals
from strata.clock import ManualClock
from strata.errors import ConfigError
from strata.gateway.app import create_gateway_app
from strata.gateway.config import ClassConfig, GatewayConfig
from strata.registry.models import (
    Deployment,
    ModelRegistry,
    ModelRouting,
    ModelVersion,
    PoolSize,
    create_model_registry,
)
from strata.sim import load_profile

PROFILE = load_profile("smollm2-cpu")
Rate = Callable[[float], float]


def law(**fields: object) -> ScalingLaw:
    config = AutoscaleConfig(**{"min_replicas": 1, "max_replicas": 6, **fields})  # type: ignore[arg-type]
    return ScalingLaw(config, CapacityModel(PROFILE, config.max_num_seqs, config.itl_slo_s))


@functools.cache
def mu(role: str) -> float:
    return CapacityModel(PROFILE, 64, 0.1, role).requests_per_s(200, 100)


def test_each_role_has_its_half_of_the_work_as_capacity() -> None:
    prefill, decode, mixed = mu("prefill"), mu("decode"), mu("mixed")
    assert 1 / mixed == pytest.approx(1 / prefill + 1 / decode)  # one request: both halves
    assert prefill > mixed and decode > mixed


def pools(**sizes: int) -> tuple[PoolSize, ...]:
    """`prefill=1, decode=2, fast=1` -> pools (a name other than a role: a mixed class pool)."""
    return tuple(PoolSize(label, replicas=n) if label in ("prefill", "decode", "mixed")
                 else PoolSize(pool=label, replicas=n) for label, n in sizes.items())


async def seeded(deployment: Deployment) -> ModelRegistry:
    models = create_model_registry("memory://")
    await models.add_version(ModelVersion("m", "v1", "sim:smollm2-cpu"))
    await models.set_routing(ModelRouting("m", live="v1"), expected_revision=0)
    await models.put_deployment(deployment, expected_revision=0)
    return models


def traffic(rates: dict[str, Rate], window_s: float, recent_s: float) -> object:
    """A signal reader: each pool's arrivals at its own rate (the mean of `rate` over the
    window and the recent span), every replica ready, nothing waiting."""
    def mean(rate: Rate, now: float, span: float) -> float:
        steps = 50
        return sum(rate(now - span * (i + 0.5) / steps) for i in range(steps)) / steps

    def read(now: float, deployment: Deployment) -> Signals:
        rate = rates[deployment.pools[0].label]
        recent = mean(rate, now, recent_s)
        return Signals(now=now, desired=deployment.replicas, ready=deployment.replicas,
                       arrival_rate=mean(rate, now, window_s), recent_rate=recent,
                       num_recent=round(recent * recent_s))
    return read


def run(deployment: Deployment, rates: dict[str, Rate], until_s: float,
        scaling: ScalingLaw | None = None) -> tuple[dict[str, list[int]], Autoscaler]:
    """Rounds every interval until `until_s`; each pool's replicas after every round."""
    scaling = scaling or law(window_s=10.0)
    cfg = scaling.config

    async def story() -> tuple[dict[str, list[int]], Autoscaler]:
        models, clock = await seeded(deployment), ManualClock(0.0)
        scaler = Autoscaler(scaling, models, model="m", owner="gw", clock=clock,
                            read_signals=traffic(rates, cfg.window_s, cfg.recent_s))  # type: ignore[arg-type]
        seen: dict[str, list[int]] = {label: [] for label in rates}
        while clock() <= until_s:
            await scaler.round()
            (stored,) = await models.list_deployments()
            for pool in stored.pools:
                seen[pool.label].append(pool.replicas)
            clock.advance(cfg.interval_s)
        return seen, scaler

    return asyncio.run(story())


def step(before: float, after: float, at_s: float) -> Rate:
    return lambda t: before if t < at_s else after


def test_a_prefill_heavy_step_grows_only_the_prefill_pool_and_it_shrinks_back_alone() -> None:
    prefill = lambda t: 0.5 * mu("prefill") if t < 20 or t >= 120 else 3.2 * mu("prefill")  # noqa: E731
    seen, scaler = run(Deployment("m", "v1", 2, pools=pools(prefill=1, decode=1)),
                       {"prefill": prefill, "decode": step(0.5 * mu("decode"), 0.5, 1e9)},
                       until_s=400)
    assert max(seen["prefill"]) == 4 and seen["prefill"][-1] == 1
    assert set(seen["decode"]) == {1}
    ups = {pool for pool, direction, _ in scaler.num_pool_decisions if direction != "hold"}
    assert ups == {"prefill"}
    first_up = next(i for i, n in enumerate(seen["prefill"]) if n > 1) * scaler.config.interval_s
    assert 20 < first_up <= 20 + 2  # the fast path: a step is seen within two seconds


def test_a_decode_heavy_step_grows_only_the_decode_pool_by_decode_capacity() -> None:
    seen, _ = run(Deployment("m", "v1", 2, pools=pools(prefill=1, decode=1)),
                  {"prefill": step(0.5 * mu("prefill"), 0.5 * mu("prefill"), 0),
                   "decode": step(0.5 * mu("decode"), 2.6 * mu("decode"), 20)}, until_s=40)
    assert set(seen["prefill"]) == {1}
    # 2.6 decode instances' worth at 0.9 utilization: 3 decode instances, not the 2.6 * mu_d /
    # mu_mixed mixed ones the load would need
    assert seen["decode"][-1] == math.ceil(2.6 / 0.9 - 0.05) == 3


def test_a_class_pool_grows_on_its_own_class_load_and_takes_its_own_bounds() -> None:
    scaling = law(window_s=10.0, pool_bounds=(("fast", 1, 2),))
    seen, scaler = run(Deployment("m", "v1", 2, pools=pools(mixed=1, fast=1)),
                       {"mixed": step(0.5 * mu("mixed"), 0.5 * mu("mixed"), 0),
                        "fast": step(0.5 * mu("mixed"), 3.2 * mu("mixed"), 20)},
                       until_s=40, scaling=scaling)
    assert set(seen["mixed"]) == {1}
    assert seen["fast"][-1] == 2  # 4 wanted, its --pool-replicas max is 2
    assert scaler.num_pool_decisions.get(("fast", "hold", "at_max_replicas"), 0) > 0


def test_a_pooled_gateway_reads_each_pool_and_reports_each_on_metrics_and_dashboard() -> None:
    async def story() -> None:
        models = await seeded(Deployment("m", "v1", 3, pools=pools(prefill=1, decode=2)))
        views = [view("p0", "m", version="v1", role="prefill", waiting=4),
                 view("d0", "m", version="v1", role="decode", running=30),
                 view("d1", "m", version="v1", role="decode", running=50)]
        views[0].num_in_flight_tokens = 900
        scaler = Autoscaler(law(window_s=1.0), models, model="m", owner="gw",
                            clock=ManualClock(5.0))
        app = create_gateway_app(GatewayConfig(classes=ClassConfig(hold_without_instances=True)),
                                 FixedSource(*views), run_background=False,
                                 autoscaler=GatewayAutoscaler(scaler))
        got = await scaler.round()
        assert got is not None
        prefill, decode = (p.signals for p in got.pools)
        assert (prefill.desired, prefill.ready, prefill.waiting, prefill.in_flight_tokens) == \
            (1, 1, 4, 900)
        assert (decode.desired, decode.ready, decode.running, decode.waiting) == (2, 2, 80, 0)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            metrics = (await client.get("/metrics")).text
            dashboard = (await client.get("/dashboard/data")).json()
        assert 'strata:autoscaler_pool_replicas{kind="ready",pool="decode"} 2.0' in metrics
        assert 'strata:autoscaler_pool_signal{name="running",pool="decode"} 80.0' in metrics
        assert 'strata:autoscaler_pool_signal{name="itl_slo_s",pool="decode"} 0.1' in metrics
        assert 'strata:autoscaler_pool_decisions_total{direction="hold",pool="prefill",' \
            'reason="first_window"} 1.0' in metrics
        assert [(t["role"], t["desired"]) for t in dashboard["autoscaler"]["targets"]] == \
            [("prefill", 1), ("decode", 2)]

    asyncio.run(story())


def test_while_it_wants_more_replicas_than_are_ready_requests_wait_for_them() -> None:
    async def story() -> None:
        models = await seeded(Deployment("m", "v1", 1))
        clock = ManualClock(0.0)
        scaler = Autoscaler(law(window_s=1.0), models, model="m", owner="gw", clock=clock)
        linked = GatewayAutoscaler(scaler)
        app = create_gateway_app(GatewayConfig(classes=ClassConfig(hold_without_instances=True)),
                                 FixedSource(view("m-v1-0", "m", version="v1")),
                                 run_background=False, autoscaler=linked)
        bound = app.state.gateway.classes.bound
        scaler.read_signals = traffic({"mixed": lambda t: 3.5 * mu("mixed")}, 1.0, 2.0)  # type: ignore[assignment]
        await scaler.round()
        assert not linked.is_growing() and not bound.is_capacity_coming
        clock.set(5.0)
        got = await scaler.round()
        assert got is not None and (got.decision.desired, got.signals.ready) == (4, 1)
        assert linked.is_growing() and bound.limit_s() == bound.start_wait_s

    asyncio.run(story())


def test_strata_up_seeds_its_pools_and_passes_their_bounds_to_the_gateway(tmp_path: Any) -> None:
    import argparse

    from strata.commands import up
    from strata.commands.env import CliEnv

    parser = argparse.ArgumentParser(prog="strata")
    up.add_parser(parser.add_subparsers(dest="command"))
    env = CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run")
    args = parser.parse_args(["up", "--simulate", "smollm2-cpu", "--prefill", "1", "--decode",
                              "2", "--pool", "fast=1", "--autoscale",
                              "--pool-replicas", "prefill=1:4"])
    config = up._config(args, env)
    assert config.replicas == 4
    assert [(p.label, p.replicas) for p in config.pools] == [
        ("prefill", 1), ("decode", 2), ("fast", 1)]
    gateway = list(config.gateway_args)
    assert gateway[gateway.index("--pool-replicas") + 1] == "prefill=1:4"
    plain = up._config(parser.parse_args(["up", "--simulate", "smollm2-cpu"]), env)
    assert (plain.replicas, plain.pools) == (2, ())  # unpooled, as before
    with pytest.raises(ConfigError, match="--pool wants NAME=N"):
        up._config(parser.parse_args(["up", "--simulate", "smollm2-cpu", "--pool", "x"]), env)


def test_a_class_pool_counts_the_requests_placed_in_it_and_no_others() -> None:
    from strata.gateway.routing.policies.base import RouteRequest
    from strata.types import PriorityClass

    async def story() -> None:
        models = await seeded(Deployment("m", "v1", 2, pools=pools(mixed=1, fast=1)))
        clock = ManualClock(0.0)
        scaler = Autoscaler(law(window_s=1.0), models, model="m", owner="gw", clock=clock)
        classes = ClassConfig(class_pools=(("interactive", "fast"),), instance_slots=4)
        app = create_gateway_app(GatewayConfig(classes=classes), FixedSource(
            view("m-v1-0", "m", version="v1"), view("m-v1-1", "m", version="v1", pool="fast")),
            run_background=False, autoscaler=GatewayAutoscaler(scaler))
        flow = app.state.gateway.classes
        await scaler.round()
        for _ in range(3):
            await flow.acquire(RouteRequest(model="m", priority=int(PriorityClass.INTERACTIVE)))
        clock.set(1.0)
        got = await scaler.round()
        assert got is not None
        by_pool = {p.pool.label: p.signals for p in got.pools}
        assert (by_pool["fast"].num_recent, by_pool["mixed"].num_recent) == (3, 0)
        assert (by_pool["fast"].ready, by_pool["mixed"].ready) == (1, 1)

    asyncio.run(story())
