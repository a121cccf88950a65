"""The autoscaler over a real local Ray: it writes the desired replicas, the Ray launcher
reconciles them, and an actor is added under load and removed (drained) when the load falls.
The load is scripted; the fleet, the registry and the actors are real."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray_cluster import ray_launcher

from strata.autoscale.capacity import CapacityModel
from strata.autoscale.config import AutoscaleConfig
from strata.autoscale.controller import Autoscaler
from strata.autoscale.law import ScalingLaw, Signals
from strata.cluster.local import LocalClusterConfig, free_port
from strata.cluster.ray_launcher import RayLauncher
from strata.cluster.seed import ClusterSeed
from strata.registry import InstanceState, create_registry
from strata.registry.models import Deployment, ModelVersion, create_model_registry
from strata.sim import load_profile

V1 = ModelVersion("smol", "v1", "sim:smollm2-cpu")
CONFIG = AutoscaleConfig(min_replicas=1, max_replicas=2, window_s=1.0, interval_s=0.25,
                         up_dwell_s=0.0, down_dwell_s=1.0, down_after_up_s=1.0, lease_s=5.0)
LAW = ScalingLaw(CONFIG, CapacityModel(load_profile("smollm2-cpu"), 64, CONFIG.itl_slo_s))


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[RayLauncher]:
    cluster = LocalClusterConfig(replicas=1, run_dir=tmp_path / "run", port=free_port(),
                                 stop_timeout_s=10, serve_args=("--log-level", "warning"),
                                 reconcile_interval_s=0.25)
    with ray_launcher(cluster, ClusterSeed(V1, replicas=1)) as launched:
        yield launched


def test_the_autoscaler_adds_an_actor_under_load_and_removes_it_after(
        launcher: RayLauncher) -> None:
    url = launcher.config.cluster.registry_url
    load = {"replicas": 1.5}  # replicas' worth of requests the script asks for
    seen: list[tuple[int, int]] = []  # (desired, actors) after each round

    async def story() -> None:
        models, instances = create_model_registry(url), create_registry(url)

        def read(now: float, deployment: Deployment) -> Signals:
            return Signals(now=now, desired=deployment.replicas, ready=ready[0],
                           arrival_rate=load["replicas"] * LAW.mu)

        ready = [0]
        scaler = Autoscaler(LAW, models, model="smol", owner="test", read_signals=read)
        try:
            async def until(predicate: Any, timeout_s: float) -> None:
                deadline = time.monotonic() + timeout_s
                while not predicate():
                    assert time.monotonic() < deadline, f"timed out; rounds {seen[-5:]}"
                    ready[0] = sum(r.state == InstanceState.READY
                                   for r in await instances.list_instances())
                    await scaler.round()
                    await asyncio.to_thread(launcher.poll)
                    seen.append(((await models.list_deployments())[0].replicas,
                                 len(launcher.instances)))
                    await asyncio.sleep(CONFIG.interval_s)

            await until(lambda: ready[0] == 1, 240)  # the first actor: Ray and the model
            # start under whatever else the machine runs (CI once needed more than 120 s)
            await until(lambda: ready[0] == 2, 120)  # 1.5 replicas' worth / 0.9 -> 2
            assert len(launcher.instances) == 2
            load["replicas"] = 0.2
            await until(lambda: len(launcher.instances) == 1 and ready[0] == 1, 120)
        finally:
            await models.close()
            await instances.close()

    asyncio.run(story())
    desired = [d for d, _ in seen]
    assert desired[0] == 1 and 2 in desired and desired[-1] == 1
    assert [r.instance_id for r in asyncio.run(_records(url))] == ["smol-v1-0"]


async def _records(url: str) -> list[Any]:
    instances = create_registry(url)
    try:
        return [r for r in await instances.list_instances() if r.state != InstanceState.DEAD]
    finally:
        await instances.close()
