"""A `RayLauncher` on a real local Ray for the tests: the registry seeded with one model version,
Ray started on 2 CPUs, the launcher reconciling; stopped (and Ray shut down) on exit."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import ray

from strata.cluster.local import LocalClusterConfig
from strata.cluster.ray_launcher import RayClusterConfig, RayLauncher
from strata.cluster.seed import ClusterSeed, seed_registry
from strata.registry import create_registry
from strata.registry.models import create_model_registry


async def seed(registry_url: str, cluster_seed: ClusterSeed) -> None:
    models, instances = create_model_registry(registry_url), create_registry(registry_url)
    try:
        await seed_registry(models, instances, cluster_seed)
    finally:
        await models.close()
        await instances.close()


@contextmanager
def ray_launcher(cluster: LocalClusterConfig, cluster_seed: ClusterSeed) -> Iterator[RayLauncher]:
    cluster.run_dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(seed(cluster.registry_url, cluster_seed))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    launched = RayLauncher(RayClusterConfig(cluster, num_cpus_per_instance=0.5))
    try:
        launched.start()
        yield launched
    finally:
        launched.stop()
        ray.shutdown()
