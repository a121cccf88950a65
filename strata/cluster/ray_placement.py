"""How the ranks of one instance sit in a Ray placement group (no torch: `strata up --ray`
imports this to make each replica's group).

W = T x P bundles, bundle i for rank i. STRICT_PACK with one pipeline stage: tensor parallel
all-reduces twice a layer, so its ranks share one node (and its memory). PACK with several
stages: the stages may spread over nodes when one is full, since a stage hands on its hidden
states once a step. Bundle 0 is rank 0, the `strata serve` process. The ranks of a CUDA
instance reserve one GPU each in their bundles, so that Ray places them where GPUs are free and
gives each actor its own (CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

from collections.abc import Sequence

NODE_PIN = 0.001  # of the `node:<ip>` resource: pins a bundle to a node, reserves nothing


def strategy_of(pipeline_size: int) -> str:
    return "STRICT_PACK" if pipeline_size == 1 else "PACK"


def gpus_per_rank(serve_argv: Sequence[str]) -> float:
    """1 when a `strata serve` command line asks for CUDA (`--device cuda[:N]`), else 0: the
    driver cannot know the nodes' GPUs, so an instance reserves them only when told."""
    device = None
    for i, arg in enumerate(serve_argv):
        if arg == "--device" and i + 1 < len(serve_argv):
            device = serve_argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    return 1.0 if device is not None and device.startswith("cuda") else 0.0


def rank_bundles(world_size: int, cpus_per_rank: float, node_ip: str | None = None, *,
                 gpus_per_rank: float = 0.0) -> list[dict[str, float]]:
    """One bundle per rank (with `gpus_per_rank` GPUs when > 0); bundle 0 (rank 0, the serving
    process) pinned to `node_ip`."""
    gpus = {"GPU": gpus_per_rank} if gpus_per_rank > 0 else {}
    bundles = [{"CPU": cpus_per_rank, **gpus} for _ in range(world_size)]
    if node_ip is not None:
        bundles[0][f"node:{node_ip}"] = NODE_PIN
    return bundles
