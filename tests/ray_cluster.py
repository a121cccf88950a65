"""Real Ray for the tests, always on the loopback.

- `local_ray()`: one local Ray node on 127.0.0.1, started as Strata starts one (ray_node.py).
- `ray_launcher(...)`: the registry seeded, then a `RayLauncher` that starts its own local Ray
  exactly as `strata up --ray` does; stopped (and Ray shut down) on exit.
- `fake_nodes(...)`: a Ray cluster of several nodes on this machine (Ray's `cluster_utils.Cluster`):
  a head on 127.0.0.1 and worker nodes on 127.0.0.2, 127.0.0.3, ..., each with its own raylet,
  object store and resources, so that node identities and addresses really differ without
  leaving the loopback. The driver (the test) is connected to the head.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from strata.cluster import ray_node
from strata.cluster.local import LocalClusterConfig
from strata.cluster.ray_launcher import RayClusterConfig, RayLauncher
from strata.cluster.seed import ClusterSeed, seed_registry
from strata.registry import create_registry
from strata.registry.models import create_model_registry

OBJECT_STORE_BYTES = 80 * 2**20  # per node: the tests move no large objects
# The GCS declares a node dead after this many failed health checks in a row, one a second
# (Ray's defaults: 5, every 3 s, so a killed node is seen ~15 s later). A killed raylet fails
# each check at once (refused); a live one under load still has Ray's 10 s to answer each.
NODE_LOSS_SEEN_FAST = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


async def seed(registry_url: str, cluster_seed: ClusterSeed) -> None:
    models, instances = create_model_registry(registry_url), create_registry(registry_url)
    try:
        await seed_registry(models, instances, cluster_seed)
    finally:
        await models.close()
        await instances.close()


@contextmanager
def local_ray(num_cpus: int = 2) -> Iterator[None]:
    """One local Ray node on the loopback, this process its driver."""
    ray_node.connect(None, num_cpus=num_cpus)
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def ray_launcher(cluster: LocalClusterConfig, cluster_seed: ClusterSeed,
                 **config: Any) -> Iterator[RayLauncher]:
    """A `RayLauncher` (RayClusterConfig fields in `config`) on a local Ray it starts itself, or
    on the Ray this process is connected to (which it leaves connected)."""
    cluster.run_dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(seed(cluster.registry_url, cluster_seed))
    was_connected = ray.is_initialized()
    launched = RayLauncher(RayClusterConfig(cluster, **{"num_cpus_per_instance": 0.5, **config}))
    try:
        launched.start()
        yield launched
    finally:
        launched.stop()
        if not was_connected:
            ray.shutdown()


def node_address(index: int) -> str:
    """The loopback address of fake node `index` (0: the head)."""
    return f"127.0.0.{index + 1}"


@contextmanager
def fake_nodes(*worker_cpus: float, head_cpus: float = 0,
               worker_resources: dict[str, float] | None = None,
               system_config: dict[str, Any] | None = None) -> Iterator[Cluster]:
    """A head (`head_cpus`) and one worker node per entry of `worker_cpus`, each on its own
    loopback address (`node_address`); the driver connected to the head. Every node is removed
    on exit, and the machine's "latest cluster" file no longer names this one. `system_config`:
    Ray's `_system_config` for the cluster (its defaults when None), e.g. NODE_LOSS_SEEN_FAST."""
    head_args: dict[str, Any] = {
        "node_ip_address": node_address(0), "num_cpus": head_cpus,
        "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False}
    if system_config is not None:
        head_args["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    try:
        for i, cpus in enumerate(worker_cpus, start=1):
            cluster.add_node(node_ip_address=node_address(i), num_cpus=cpus,
                             object_store_memory=OBJECT_STORE_BYTES,
                             resources=dict(worker_resources or {}))
        ray_node.connect(cluster.address, node_ip=node_address(0))
        yield cluster
    finally:
        ray.shutdown()
        address = cluster.address
        cluster.shutdown()
        _forget_latest_cluster(address)


def _forget_latest_cluster(address: str | None) -> None:
    """Ray's `Cluster` writes its address as the machine's latest cluster, which a later
    `ray.init()` without an address would try to join; remove it when it names ours."""
    from ray._private.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    if address and path.is_file() and path.read_text().strip() == address:
        path.unlink(missing_ok=True)
