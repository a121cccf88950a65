"""The autoscaler's controller (strata/autoscale/controller.py) over a registry: one leader
through the lease, desired replicas written to the live deployment with a compare-and-set,
nothing while a release runs; inside a gateway: its signals, /metrics and the dashboard."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from gateway_fakes import FixedSource, view

from strata.autoscale.capacity import CapacityModel
from strata.autoscale.config import AutoscaleConfig
from strata.autoscale.controller import Autoscaler
from strata.autoscale.gateway_link import GatewayAutoscaler
from strata.autoscale.law import ScalingLaw, Signals
from strata.clock import ManualClock
from strata.gateway.app import create_gateway_app
from strata.gateway.config import ClassConfig, GatewayConfig
from strata.registry.models import (
    Deployment,
    ModelRegistry,
    ModelRouting,
    ModelVersion,
    Release,
    create_model_registry,
)
from strata.sim import load_profile

LAW = ScalingLaw(AutoscaleConfig(min_replicas=1, max_replicas=6, window_s=1.0),
                 CapacityModel(load_profile("smollm2-cpu"), 64, 0.1))


async def seeded(replicas: int = 1) -> ModelRegistry:
    models = create_model_registry("memory://")
    await models.add_version(ModelVersion("m", "v1", "sim:smollm2-cpu"))
    await models.set_routing(ModelRouting("m", live="v1"), expected_revision=0)
    await models.put_deployment(Deployment("m", "v1", replicas), expected_revision=0)
    return models


def busy(load: float) -> Any:
    """A signal reader: `load` replicas' worth of requests, all replicas ready."""
    def read(now: float, deployment: Deployment) -> Signals:
        return Signals(now=now, desired=deployment.replicas, ready=deployment.replicas,
                       arrival_rate=load * LAW.mu)
    return read


async def replicas(models: ModelRegistry) -> int:
    return (await models.list_deployments())[0].replicas


def test_only_the_lease_holder_writes_and_another_takes_over_when_it_stops() -> None:
    async def story() -> None:
        models, wall, clock = await seeded(), ManualClock(1000.0), ManualClock(0.0)
        a, b = (Autoscaler(LAW, models, model="m", owner=name, read_signals=busy(3.5),
                           clock=clock, wall_clock=wall) for name in ("gw-a", "gw-b"))
        await a.round()  # its first round only starts the rate's window (window_s 1 s)
        clock.set(5.0)
        first = await a.round()
        assert first is not None and first.decision.desired == 4 and first.is_written
        assert await b.round() is None and not b.is_leader and b.skipped.startswith("another")
        assert await replicas(models) == 4
        wall.advance(LAW.config.lease_s + 0.1)  # a stopped renewing: b leads from now on
        clock.set(10.0)
        assert await b.round() is not None and b.is_leader
        assert await a.round() is None and not a.is_leader
        assert a.num_decisions == {("hold", "first_window"): 1, ("up", "capacity"): 1}

    asyncio.run(story())


def test_nothing_is_decided_while_a_release_runs_or_without_a_live_version() -> None:
    async def story() -> None:
        models = await seeded()
        scaler = Autoscaler(LAW, models, model="m", owner="gw", read_signals=busy(3.5),
                            clock=ManualClock(5.0), wall_clock=ManualClock(1000.0))
        await models.put_release(Release("r1", "m", "v2", "v1"), expected_revision=0)
        assert await scaler.round() is None and "release" in scaler.skipped
        other = Autoscaler(LAW, models, model="x", owner="gw", read_signals=busy(3.5))
        assert await other.round() is None and "no live version" in other.skipped
        assert await replicas(models) == 1

    asyncio.run(story())


class Racing:
    """A registry where someone else writes the deployment just before each write of ours."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models

    def __getattr__(self, name: str) -> Any:
        return getattr(self.models, name)

    async def put_deployment(self, deployment: Deployment, *,
                             expected_revision: int) -> Deployment:
        await self.models.put_deployment(deployment.resized(2),
                                         expected_revision=expected_revision)
        return await self.models.put_deployment(deployment,
                                                expected_revision=expected_revision)


def test_a_deployment_changed_meanwhile_is_left_to_the_next_round() -> None:
    async def story() -> None:
        models = await seeded()
        clock = ManualClock(0.0)
        scaler = Autoscaler(LAW, Racing(models), model="m", owner="gw",  # type: ignore[arg-type]
                            read_signals=busy(3.5), clock=clock)
        await scaler.round()
        clock.set(5.0)
        got = await scaler.round()
        assert got is not None and got.decision.desired == 4
        assert not got.is_written and await replicas(models) == 2

    asyncio.run(story())


def test_inside_a_gateway_it_reads_the_gateway_and_reports_on_metrics_and_dashboard() -> None:
    async def story() -> None:
        models = await seeded(replicas=2)
        views = [view("m-v1-0", "m", version="v1"), view("m-v1-1", "m", version="v1",
                                                         waiting=3)]
        views[0].num_in_flight = 5
        scaler = Autoscaler(LAW, models, model="m", owner="gw", clock=ManualClock(5.0))
        linked = GatewayAutoscaler(scaler)
        config = GatewayConfig(classes=ClassConfig(hold_without_instances=True))
        app = create_gateway_app(config, FixedSource(*views), run_background=False,
                                 autoscaler=linked)
        got = await scaler.round()
        assert got is not None
        s = got.signals
        assert (s.desired, s.ready, s.waiting, s.in_flight, s.queued) == (2, 2, 3, 5, 0)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            metrics = (await client.get("/metrics")).text
            dashboard = (await client.get("/dashboard/data")).json()
        assert "strata:autoscaler_desired_replicas " in metrics
        assert 'strata:autoscaler_signal{name="waiting"} 3.0' in metrics
        assert 'strata:autoscaler_decisions_total{direction="hold",reason="first_window"} 1.0' \
            in metrics  # its first round starts the rate's window
        assert dashboard["autoscaler"]["owner"] == "gw"
        assert dashboard["autoscaler"]["targets"][0]["desired"] == got.decision.desired

    asyncio.run(story())
