"""The tensor / pipeline parallel side of `strata up`: `-tp T -pp P` gives every instance T x P
ranks (strata/commands/serve_parallel.py). The instance's threads are shared out over its ranks,
and under `--ray` each replica is one placement group (strata/cluster/ray_launcher.py)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from strata.commands.argtypes import positive_int

if TYPE_CHECKING:
    from strata.cluster.local import LocalClusterConfig
    from strata.cluster.ray_launcher import RayClusterConfig

SERVE_FLAGS: tuple[tuple[str, Any], ...] = (
    ("--tensor-parallel-size", positive_int), ("--pipeline-parallel-size", positive_int),
    ("--pipeline-layers", str),
)
SHORT_FLAGS = {"--tensor-parallel-size": ("-tp",), "--pipeline-parallel-size": ("-pp",)}


def ranks_per_instance(args: argparse.Namespace) -> int:
    return int((args.tensor_parallel_size or 1) * (args.pipeline_parallel_size or 1))


def rank_threads(args: argparse.Namespace, replicas: int) -> int:
    """`strata serve --threads` for every instance, which is per rank: the instance's threads
    (--threads-per-instance, else cores / replicas) over its ranks, at least 1."""
    threads = args.threads_per_instance or max(1, (os.cpu_count() or 1) // max(1, replicas))
    return max(1, int(threads) // ranks_per_instance(args))


def ray_config(args: argparse.Namespace, cluster: LocalClusterConfig) -> RayClusterConfig:
    from strata.cluster.ray_launcher import RayClusterConfig

    return RayClusterConfig(cluster, address=args.address,
                            num_cpus_per_instance=args.num_cpus_per_instance,
                            tensor_parallel_size=args.tensor_parallel_size or 1,
                            pipeline_parallel_size=args.pipeline_parallel_size or 1,
                            placement=args.placement)


__all__ = ["SERVE_FLAGS", "SHORT_FLAGS", "rank_threads", "ranks_per_instance", "ray_config"]
