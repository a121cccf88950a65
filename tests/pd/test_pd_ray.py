"""`strata up --ray --prefill 1 --decode 1` on a real local Ray (simulated instances): the actors
start with their roles and the gateway hands a long prompt over from one to the other."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ray_cluster import ray_launcher

from strata.cluster.local import LocalClusterConfig
from strata.cluster.ports import free_port
from strata.cluster.ray_launcher import RayLauncher
from strata.cluster.seed import ClusterSeed
from strata.registry import InstanceState, create_registry
from strata.registry.models import ModelVersion

V1 = ModelVersion("smol", "v1", "sim:smollm2-cpu")


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayLauncher]:
    root = tmp_path_factory.mktemp("ray-pd")
    cluster = LocalClusterConfig(replicas=2, num_prefill=1, run_dir=root / "run",
                                 port=free_port(), stop_timeout_s=10,
                                 serve_args=("--log-level", "warning"),
                                 reconcile_interval_s=0.25)
    with ray_launcher(cluster, ClusterSeed(V1, replicas=2, pools=cluster.pools)) as launched:
        yield launched


def roles(url: str) -> dict[str, str]:
    async def go() -> dict[str, str]:
        registry = create_registry(url)
        try:
            return {r.instance_id: r.role.value for r in await registry.list_instances()
                    if r.state == InstanceState.READY}
        finally:
            await registry.close()

    return asyncio.run(go())


def routable(gateway: str) -> int:
    try:
        views = httpx.get(f"{gateway}/admin/instances", timeout=2).json()["instances"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(v["routable"] for v in views)


def test_ray_actors_take_their_roles_and_hand_off(launcher: RayLauncher) -> None:
    cluster = launcher.config.cluster
    gateway = f"http://{cluster.host}:{cluster.port}"
    deadline = time.monotonic() + 180
    while (len(roles(cluster.registry_url)) < 2 or routable(gateway) < 2) \
            and time.monotonic() < deadline:
        launcher.poll()
        time.sleep(0.25)
    assert roles(cluster.registry_url) == {"smol-v1-0": "prefill", "smol-v1-1": "decode"}
    body: dict[str, Any] = {"model": "smol", "prompt": list(range(100, 500)), "max_tokens": 4,
                            "temperature": 0}
    answer = httpx.post(f"{gateway}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-strata-instance"] == "smol-v1-1"
    metrics = httpx.get(f"{gateway}/metrics").text
    assert 'strata:gateway_pd_prefills_total{outcome="ok"} 1.0' in metrics
