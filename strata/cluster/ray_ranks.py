"""`--distributed-executor ray`: the ranks of one instance as Ray actors in one placement group.

An instance is one placement group of W = T x P bundles, bundle i for rank i. Rank 0 is the
`strata serve` process itself, and bundle 0 holds its CPUs:

- under `strata up --ray` the instance actor, which owns the `strata serve` process, sits in
  bundle 0 of a group that `strata up` made for the replica (`--ray-placement-group ID`). So the
  group is the replica: placed as a whole, the serving process on the node of bundle 0, and when
  Ray restarts the actor it comes back into bundle 0 of the same group;
- a `strata serve` on its own makes the group, bundle 0 pinned to its node (Ray's `node:<ip>`
  resource), and removes it when it stops.

`strata serve` joins Ray as a driver of the node it runs on (`node_ip`, which `strata up --ray`
passes; without an address it starts a local Ray on the loopback: ray_node.py). Ranks 1 .. W-1
are `RankActor`s in bundles 1 .. W-1 (the strategy: ray_placement.py). A rank's host is its
bundle's node, read from Ray's placement group table before any rank starts: ranks on rank 0's
node (the same node id) share memory, the others talk through gloo with the rendezvous at rank
0's node address (comm.plan_comm).

Failure: a rank actor that dies ends its `serve` call (RayActorError) and the watcher reports it;
its peers' collectives see its pid gone within ~50 ms. The actors belong to the `strata serve`
process (a Ray driver): Ray kills them when it exits, and never restarts one alone.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

from strata.cluster import ray_node
from strata.cluster.ray_placement import rank_bundles, strategy_of
from strata.errors import ConfigError, ModelLoadError, RankFailedError
from strata.model.parallel.comm import Host
from strata.model.parallel.commands import RankReport, RankSpec
from strata.model.parallel.launcher import OnExit
from strata.model.parallel.layout import ParallelLayout

log = logging.getLogger("strata.cluster.ray_ranks")


@dataclass(frozen=True, slots=True)
class RayPlacement:
    """Where the ranks of one `strata serve` go on Ray."""

    address: str | None = None  # None: a new local Ray on the loopback
    node_ip: str | None = None  # the node this process runs on (None: Ray's pick)
    placement_group: str | None = None  # hex id of a group `strata up --ray` made
    cpus_per_rank: float | None = None  # default: the cluster's CPUs shared out, at most 1
    gpus_per_rank: float = 0.0  # CUDA ranks: 1 (reserved in each rank's bundle)

    def __post_init__(self) -> None:
        if self.cpus_per_rank is not None and self.cpus_per_rank <= 0:
            raise ConfigError("--ray-cpus-per-rank must be > 0 (fractions are allowed)")


class RankActor:
    """A rank as a Ray actor: `start` joins the groups and loads the shard (its report, or the
    rank's own error), `serve` runs commands until Stop or a failed collective."""

    def __init__(self) -> None:
        self._rank: Any = None

    def start(self, spec: RankSpec) -> RankReport:
        import ray

        from strata.model.parallel.worker import start_rank

        logging.basicConfig(level=logging.INFO,
                            format=f"rank {spec.rank} %(levelname)s: %(message)s")
        if spec.device.startswith("cuda") and ray.get_gpu_ids():
            spec = dataclasses.replace(spec, device="cuda:0")  # Ray shows this actor its GPU
        self._rank = start_rank(spec)
        report: RankReport = self._rank.report()
        return report

    def serve(self) -> int:
        from strata.model.parallel.worker import serve_rank

        return serve_rank(self._rank)


class RayRankLauncher:
    """A `RankLauncher` over Ray (see the module docstring). Connects this process to Ray
    (`placement.address`) unless it already is."""

    def __init__(self, placement: RayPlacement, *, ready_timeout_s: float = 120.0) -> None:
        self.placement = placement
        self.ready_timeout_s = ready_timeout_s
        self._group: Any = None
        self._owns_group = False
        self._cpus: list[float] = []
        self._gpus: list[float] = []
        self._actors: dict[int, Any] = {}
        self._starting: dict[Any, int] = {}  # start() refs -> rank
        self._serving: dict[Any, int] = {}  # serve() refs -> rank
        self._reports: dict[int, RankReport] = {}
        self._stopping = threading.Event()

    def place(self, layout: ParallelLayout) -> list[Host]:
        import ray

        ray_node.connect(self.placement.address, node_ip=self.placement.node_ip)
        here = ray_node.this_node()
        self._group = self._existing_group() or self._new_group(layout, here.address)
        ray.get(self._group.ready(), timeout=self.ready_timeout_s)
        self._cpus = [float(b.get("CPU", 0)) for b in self._group.bundle_specs]
        self._gpus = [float(b.get("GPU", 0)) for b in self._group.bundle_specs]
        if len(self._cpus) != layout.world_size:
            raise ConfigError(f"placement group {self._group.id.hex()} has {len(self._cpus)} "
                              f"bundles; a {layout.name} instance needs {layout.world_size}")
        hosts = bundle_hosts(self._group)
        if hosts[0].id != here.id:
            raise ConfigError(f"bundle 0 of placement group {self._group.id.hex()} is on node "
                              f"{hosts[0].address}, but rank 0 runs on node {here.address}")
        return hosts

    def _existing_group(self) -> Any:
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup

        hex_id = self.placement.placement_group
        return PlacementGroup(PlacementGroupID(bytes.fromhex(hex_id))) if hex_id else None

    def _new_group(self, layout: ParallelLayout, here: str) -> Any:
        import ray
        from ray.util.placement_group import placement_group

        cpus = self.placement.cpus_per_rank or min(
            1.0, float(ray.cluster_resources().get("CPU", 1)) / layout.world_size)
        self._owns_group = True
        return placement_group(rank_bundles(layout.world_size, cpus, here,
                                            gpus_per_rank=self.placement.gpus_per_rank),
                               strategy=strategy_of(layout.pipeline_size))

    def start(self, specs: list[RankSpec]) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class: Any = ray.remote(RankActor)
        for spec in specs:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=spec.rank)
            actor = actor_class.options(
                num_cpus=self._cpus[spec.rank], num_gpus=self._gpus[spec.rank],
                scheduling_strategy=strategy, max_restarts=0,
            ).remote()
            self._actors[spec.rank] = actor
            self._starting[actor.start.remote(spec)] = spec.rank

    def wait_ready(self, timeout_s: float) -> list[RankReport]:
        import ray

        done, pending = ray.wait(list(self._starting), num_returns=len(self._starting),
                                 timeout=timeout_s)
        if pending:
            ranks = sorted(self._starting[r] for r in pending)
            raise RankFailedError(f"ranks {ranks} were not ready within {timeout_s:g} s",
                                  rank=ranks[0])
        for ref in done:
            rank = self._starting[ref]
            self._reports[rank] = _report_of(ray, ref, rank)
        self._serving = {self._actors[r].serve.remote(): r for r in sorted(self._actors)}
        return [self._reports[r] for r in sorted(self._reports)]

    def watch(self, on_exit: OnExit) -> None:
        threading.Thread(target=self._watch, args=(on_exit,), daemon=True,
                         name="strata-ray-rank-watch").start()

    def _watch(self, on_exit: OnExit) -> None:
        import ray

        if not self._serving:
            return
        (ended, *_), _ = ray.wait(list(self._serving), num_returns=1, timeout=None)
        if self._stopping.is_set():
            return
        rank = self._serving[ended]
        try:
            how = f"exited with code {ray.get(ended)}"
        except Exception as exc:  # the actor died: RayActorError
            how = f"died ({type(exc).__name__})"
        on_exit(RankFailedError(f"rank {rank} (Ray actor, pid {self._reports[rank].pid}) {how}",
                                rank=rank))

    def pids(self) -> dict[int, int]:
        return {rank: report.pid for rank, report in self._reports.items()}

    def stop(self, timeout_s: float) -> None:
        import ray

        self._stopping.set()
        if self._serving:
            ray.wait(list(self._serving), num_returns=len(self._serving), timeout=timeout_s)
        for actor in self._actors.values():
            ray.kill(actor, no_restart=True)
        if self._owns_group and self._group is not None:
            ray.util.remove_placement_group(self._group)
            self._owns_group = False


def bundle_hosts(group: Any) -> list[Host]:
    """The node of each bundle of a placed group, in bundle order."""
    import ray

    table = ray.util.placement_group_table(group)
    nodes = {row["NodeID"]: ray_node.Node.of(row) for row in ray.nodes()}
    placed = [nodes[table["bundles_to_node_id"][i]] for i in range(len(group.bundle_specs))]
    return [Host(node.id, node.address) for node in placed]


def _report_of(ray: Any, ref: Any, rank: int) -> RankReport:
    try:
        report = ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        raise RankFailedError(f"rank {rank} (Ray actor) died while starting: {exc}",
                              rank=rank) from None
    except ray.exceptions.RayTaskError as exc:
        raise ModelLoadError(f"rank {rank} failed to start:\n{exc}") from None
    assert isinstance(report, RankReport)
    return report


__all__ = ["RankActor", "RayPlacement", "RayRankLauncher", "bundle_hosts"]
