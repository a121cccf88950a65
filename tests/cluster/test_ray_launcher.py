"""`strata up --ray` pieces on a real local Ray: instances are actors that Ray restarts, and the
driver reconciles them toward the deployments in the registry (simulated instances: fast)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import ray
from ray_cluster import ray_launcher

from strata.cluster.local import LocalClusterConfig, free_port
from strata.cluster.ray_launcher import RayClusterConfig, RayLauncher
from strata.cluster.seed import ClusterSeed
from strata.errors import ConfigError
from strata.registry import InstanceRecord, InstanceState, create_registry
from strata.registry.models import Deployment, DeploymentState, ModelVersion, create_model_registry

T = TypeVar("T")
V1 = ModelVersion("smol", "v1", "sim:smollm2-cpu")
V2 = ModelVersion("smol", "v2", "sim:smollm2-cpu")


def registry_call(url: str, use: Callable[[Any, Any], Coroutine[Any, Any, T]]) -> T:
    async def go() -> T:
        models, instances = create_model_registry(url), create_registry(url)
        try:
            return await use(models, instances)
        finally:
            await models.close()
            await instances.close()

    return asyncio.run(go())


def records(registry_url: str) -> list[InstanceRecord]:
    async def use(_: Any, instances: Any) -> list[InstanceRecord]:
        return list(await instances.list_instances())

    return registry_call(registry_url, use)


def wait_for(launcher: RayLauncher, predicate: Callable[[], bool], timeout_s: float,
             what: str) -> None:
    """Poll the launcher (its reconcile rounds) until `predicate` holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        launcher.poll()
        time.sleep(0.25)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayLauncher]:
    root = tmp_path_factory.mktemp("ray")
    cluster = LocalClusterConfig(
        replicas=2, run_dir=root / "run", port=free_port(), stop_timeout_s=10,
        serve_args=("--log-level", "warning"), reconcile_interval_s=0.25,
    )
    with ray_launcher(cluster, ClusterSeed(V1, replicas=2)) as launched:
        yield launched


def ready_ids(launcher: RayLauncher) -> set[str]:
    return {r.instance_id for r in records(launcher.config.cluster.registry_url)
            if r.state == InstanceState.READY}


def test_actors_serve_and_register_ready(launcher: RayLauncher) -> None:
    wait_for(launcher, lambda: ready_ids(launcher) == {"smol-v1-0", "smol-v1-1"}, 120,
             "2 ready")


def test_the_local_ray_and_every_instance_url_are_on_the_loopback(
        launcher: RayLauncher) -> None:
    """The fixture's launcher started its own Ray, as `strata up --ray` without --address
    does: its one node binds 127.0.0.1, and every instance listens and registers there."""
    wait_for(launcher, lambda: ready_ids(launcher) == {"smol-v1-0", "smol-v1-1"}, 120,
             "2 ready")
    assert [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]] == ["127.0.0.1"]
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    urls = [r.url for r in records(launcher.config.cluster.registry_url)]
    assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls), urls
    nodes = ray.get([a.node.remote() for a in launcher.actors])
    assert {n.address for n in nodes} == {"127.0.0.1"}


def test_a_killed_instance_is_restarted_by_ray_and_rejoins(launcher: RayLauncher) -> None:
    wait_for(launcher, lambda: len(ready_ids(launcher)) == 2, 120, "2 ready")
    actor = launcher.instances["smol-v1-0"].actor
    old_pid = ray.get(actor.pid.remote())
    os.kill(old_pid, signal.SIGKILL)  # the instance process dies; its actor exits; Ray restarts

    def restarted() -> bool:
        try:
            return bool(ray.get(actor.pid.remote(), timeout=5) != old_pid)
        except Exception:
            return False

    wait_for(launcher, restarted, 120, "the actor's restart")
    url = next(r.url for r in records(launcher.config.cluster.registry_url)
               if r.instance_id == "smol-v1-0")
    wait_for(launcher, lambda: "smol-v1-0" in ready_ids(launcher), 120, "smol-v1-0 ready")
    assert next(r.url for r in records(launcher.config.cluster.registry_url)
                if r.instance_id == "smol-v1-0") == url  # same port: it rejoins in place


def test_a_new_deployment_gets_actors_and_a_retiring_one_loses_them(
    launcher: RayLauncher,
) -> None:
    url = launcher.config.cluster.registry_url

    async def release(models: Any, _: Any) -> None:
        await models.add_version(V2)
        await models.put_deployment(Deployment("smol", "v2", 1), expected_revision=0)

    registry_call(url, release)
    wait_for(launcher, lambda: "smol-v2-0" in ready_ids(launcher), 120, "a ready v2 instance")

    async def retire(models: Any, _: Any) -> None:
        v1 = {d.key: d for d in await models.list_deployments()}["smol@v1"]
        await models.put_deployment(Deployment("smol", "v1", 2, DeploymentState.RETIRING),
                                    expected_revision=v1.revision)

    async def deployments(models: Any, _: Any) -> list[str]:
        return [d.key for d in await models.list_deployments()]

    registry_call(url, retire)
    wait_for(launcher, lambda: registry_call(url, deployments) == ["smol@v2"], 60,
             "the v1 deployment drained and deleted")
    assert list(launcher.instances) == ["smol-v2-0"]
    assert {r.instance_id for r in records(url)} == {"smol-v2-0"}, "v1 deregistered"


def test_several_nodes_need_a_shared_registry(tmp_path: Path) -> None:
    cluster = LocalClusterConfig(replicas=1, run_dir=tmp_path, registry="sqlite:///x.db")
    with pytest.raises(ConfigError, match="redis://"):
        RayClusterConfig(cluster, address="ray-head.example:6379")
