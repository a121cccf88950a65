"""`strata up --ray` pieces on a real local Ray: instances are actors that Ray restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray
from tiny_models import make_tiny_model_dir

from strata.cluster.local import LocalClusterConfig
from strata.cluster.ray_launcher import RayClusterConfig, RayLauncher
from strata.errors import ConfigError
from strata.registry import InstanceRecord, InstanceState, create_registry


def records(registry_url: str) -> list[InstanceRecord]:
    async def go() -> list[InstanceRecord]:
        registry = create_registry(registry_url)
        try:
            return await registry.list_instances()
        finally:
            await registry.close()

    return asyncio.run(go())


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayLauncher]:
    root = tmp_path_factory.mktemp("ray")
    model = make_tiny_model_dir(root / "tiny")
    cluster = LocalClusterConfig(
        replicas=2, run_dir=root / "run", model=str(model), port=0, stop_timeout_s=10,
        serve_args=("--dtype", "float32", "--kv-cache-gb", "0.01", "--log-level", "warning"),
        threads_per_instance=1,
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    launched = RayLauncher(RayClusterConfig(cluster, num_cpus_per_instance=0.5))
    launched.start()
    yield launched
    launched.stop()
    ray.shutdown()


def ready_ids(launcher: RayLauncher) -> set[str]:
    return {r.instance_id for r in records(launcher.config.cluster.registry_url)
            if r.state == InstanceState.READY}


def test_actors_serve_and_register_ready(launcher: RayLauncher) -> None:
    wait_for(lambda: ready_ids(launcher) == {"instance-0", "instance-1"}, 120, "2 ready")


def test_a_killed_instance_is_restarted_by_ray_and_rejoins(launcher: RayLauncher) -> None:
    wait_for(lambda: len(ready_ids(launcher)) == 2, 120, "2 ready")
    actor = launcher.actors[0]
    old_pid = ray.get(actor.pid.remote())
    os.kill(old_pid, signal.SIGKILL)  # the instance process dies; its actor exits; Ray restarts

    def restarted() -> bool:
        try:
            return bool(ray.get(actor.pid.remote(), timeout=5) != old_pid)
        except Exception:
            return False

    wait_for(restarted, 120, "the actor's restart")
    url = next(r.url for r in records(launcher.config.cluster.registry_url)
               if r.instance_id == "instance-0")
    wait_for(lambda: "instance-0" in ready_ids(launcher), 120, "instance-0 ready again")
    assert next(r.url for r in records(launcher.config.cluster.registry_url)
                if r.instance_id == "instance-0") == url  # same port: it rejoins in place


def test_several_nodes_need_a_shared_registry(tmp_path: Path) -> None:
    cluster = LocalClusterConfig(replicas=1, run_dir=tmp_path, registry="sqlite:///x.db")
    with pytest.raises(ConfigError, match="redis://"):
        RayClusterConfig(cluster, address="ray-head.example:6379")
