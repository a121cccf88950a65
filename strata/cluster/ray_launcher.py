"""`strata up --ray`: instances as Ray actors, restarted by Ray when they die.

Each actor owns one `strata serve` child process (started with PDEATHSIG so that it dies with the
actor). The child listens on, and registers, the address of the actor's Ray node: on a local Ray
(no `--address`: ray_node.py) that is the loopback, on a cluster each node's own address. When
the child exits unexpectedly the actor exits too, and Ray restarts the actor, which starts a new
child on the same port (while it is free on the node) with the same instance id: it
re-registers and the gateway sees it rejoin. The gateway itself runs on the driver, supervised
like `strata up`.

Which actors exist follows the deployments in the model registry, reconciled by the driver each
round exactly as the local supervisor does (strata/cluster/deployments.py): one actor per
instance `{name}-{version}-{index}`; an instance to drain gets `actor.stop` (SIGTERM: it drains,
deregisters, exits) and, once that returns, its actor is killed for good (no restart).
Ray is imported lazily: it is an optional dependency (`pip install 'strata[ray]'`).

A parallel instance (`--tensor-parallel-size` / `--pipeline-parallel-size`, W = T x P ranks) is
one placement group of W bundles made here, one per replica: the instance actor holds bundle 0
(its `strata serve` process is rank 0) and `strata serve --distributed-executor ray` places
ranks 1 .. W-1 in the other bundles (strata/cluster/ray_ranks.py). The group outlives restarts
of the actor, which Ray brings back into bundle 0; it is removed when the instance is drained.
`--num-cpus-per-instance` is shared out over the W bundles.

Replicas spread over the nodes by default (Ray's SPREAD strategy), so that losing a node takes
out as few of them as it can; `--placement pack` lets Ray fill one node first.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.cluster import ray_node
from strata.cluster.deployments import Slot, Start, instance_id_of
from strata.cluster.local import LocalClusterConfig, Supervisor, instance_argv
from strata.cluster.local_config import listen_args
from strata.cluster.ports import free_port, port_is_free
from strata.cluster.registry_link import Reconciler, RegistryLink
from strata.errors import ConfigError

log = logging.getLogger("strata.up.ray")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the actor process dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class InstanceActor:
    """A Ray actor that keeps one `strata serve` process alive for as long as it lives.

    `argv` is the command line less where it listens: the actor adds its node's address (to
    listen on and, as `--node`, to register) and `port` (a fresh one when `port` is taken
    there); with `joins_ray` (a parallel instance, whose ranks are Ray actors too) it also says
    which node the process is a driver of."""

    def __init__(self, argv: list[str], log_path: str, port: int,
                 joins_ray: bool = False) -> None:
        self._stopping = False
        node = ray_node.this_node()
        port = port if port_is_free(port, node.address) else free_port(node.address)
        argv = [*argv, *listen_args(node.address, port), "--node", node.address]
        argv += ["--ray-node-ip", node.address] if joins_ray else []
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the actor
        self._proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        code = self._proc.wait()
        if not self._stopping:
            self._log.write(f"[strata] instance exited with {code}; the actor exits so that "
                            "Ray restarts it\n".encode())
            self._log.flush()
            os._exit(1)

    def pid(self) -> int:
        """The pid of the `strata serve` child (tests kill it to play a crash)."""
        return int(self._proc.pid)

    def actor_pid(self) -> int:
        return os.getpid()

    def node(self) -> ray_node.Node:
        return ray_node.this_node()

    def stop(self, timeout_s: float) -> int | None:
        """Graceful stop: SIGTERM (drain, deregister), then SIGKILL after the timeout."""
        self._stopping = True
        self._proc.send_signal(signal.SIGTERM)
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()


PLACEMENTS = ("spread", "pack")


@dataclass(frozen=True, slots=True)
class RayClusterConfig:
    cluster: LocalClusterConfig
    address: str | None = None  # None: start a local Ray on the loopback (ray_node.py)
    num_cpus_per_instance: float = 0.5
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    placement: str = "spread"  # of replicas over nodes: spread or pack

    @property
    def ranks_per_instance(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        if self.num_cpus_per_instance <= 0:
            raise ConfigError("--num-cpus-per-instance must be > 0 (fractions are allowed)")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--placement {self.placement!r} is unknown; choose one of "
                              f"{', '.join(PLACEMENTS)}")
        if self.address and (self.cluster.registry or "").startswith("sqlite"):
            raise ConfigError(
                "a Ray cluster of several nodes needs a shared registry: pass --registry "
                "redis://HOST:PORT/0 (SQLite is one machine's file)"
            )


@dataclass(slots=True)
class InstanceHandle:
    """One instance actor the driver owns; `stopping` is the pending `stop` call of a drain."""

    actor: Any
    slot: Slot
    stopping: Any = field(default=None, repr=False)
    group: Any = field(default=None, repr=False)  # the placement group of a parallel instance


class RayLauncher:
    """Starts the gateway, reconciles instance actors with the deployments, stops in order."""

    def __init__(self, config: RayClusterConfig) -> None:
        self.config = config
        self.instances: dict[str, InstanceHandle] = {}  # instance id -> its actor
        self.gateway = Supervisor(config.cluster, supervise_instances=False)
        self._reconciler: Reconciler | None = None
        self._next_round_at = 0.0
        self._started_ray = False

    @property
    def actors(self) -> list[Any]:
        return [h.actor for h in self.instances.values()]

    def start(self) -> None:
        import ray

        self._started_ray = ray_node.connect(self.config.address)
        self.gateway.start()
        link = RegistryLink(self.config.cluster.registry_url)
        self._reconciler = Reconciler(link, start=self._start_instance, drain=self._drain)
        self._reconcile()
        ray.get([a.pid.remote() for a in self.actors])  # every actor constructed
        log.info("%d instance actors started", len(self.instances))

    def _start_instance(self, start: Start) -> None:
        import ray

        c, version = self.config.cluster, start.version
        instance_id = instance_id_of(version.name, version.version, start.index)
        argv = instance_argv(c, version, instance_id, None, sys.executable,
                             start.index, role=start.role, pool=start.pool)
        options: dict[str, Any] = {"num_cpus": self.config.num_cpus_per_instance}
        if self.config.placement == "spread":
            options["scheduling_strategy"] = "SPREAD"
        group = None
        if self.config.ranks_per_instance > 1 and not version.is_simulated:
            group, options = self._replica_group(argv)
        actor = ray.remote(InstanceActor).options(
            name=f"strata-{instance_id}", max_restarts=-1, max_task_retries=-1, **options,
        ).remote(argv, str(c.log_dir / f"{instance_id}.log"), free_port(),
                 joins_ray=group is not None)
        self.instances[instance_id] = InstanceHandle(actor, start.slot, group=group)

    def _replica_group(self, argv: list[str]) -> tuple[Any, dict[str, Any]]:
        """A placement group for the W ranks of one replica; the instance actor's options put
        it in bundle 0, and `argv` gets the flags that put ranks 1 .. W-1 in the others."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from strata.cluster.ray_placement import gpus_per_rank, rank_bundles, strategy_of

        num_ranks = self.config.ranks_per_instance
        cpus, gpus = self.config.num_cpus_per_instance / num_ranks, gpus_per_rank(argv)
        group = placement_group(rank_bundles(num_ranks, cpus, gpus_per_rank=gpus),
                                strategy=strategy_of(self.config.pipeline_parallel_size))
        argv += ["--distributed-executor", "ray", "--ray-placement-group", group.id.hex(),
                 "--ray-address", ray.get_runtime_context().gcs_address]
        return group, {"num_cpus": cpus, "num_gpus": gpus,
                       "scheduling_strategy": PlacementGroupSchedulingStrategy(
                           placement_group=group, placement_group_bundle_index=0)}

    def _drain(self, instance_id: str) -> None:
        handle = self.instances[instance_id]
        handle.slot = dataclasses.replace(handle.slot, is_draining=True)
        handle.stopping = handle.actor.stop.remote(self.config.cluster.stop_timeout_s)
        log.info("draining %s", instance_id)

    def _collect_drained(self) -> None:
        """Kill (for good) the actors whose drain finished; their ids become free again."""
        import ray

        draining = {iid: h for iid, h in self.instances.items() if h.stopping is not None}
        if not draining:
            return
        done, _ = ray.wait([h.stopping for h in draining.values()],
                           num_returns=len(draining), timeout=0)
        for iid, handle in draining.items():
            if handle.stopping in done:
                code = ray.get(handle.stopping)
                ray.kill(handle.actor, no_restart=True)
                _remove_group(handle)
                del self.instances[iid]
                log.info("%s drained and exited with %s; its actor is gone", iid, code)

    def _reconcile(self) -> None:
        assert self._reconciler is not None
        self._next_round_at = time.monotonic() + self.config.cluster.reconcile_interval_s
        self._reconciler.round({iid: h.slot for iid, h in self.instances.items()})

    def poll(self) -> None:
        self.gateway.poll()  # Ray restarts the actors; the driver keeps the gateway alive
        if self._reconciler is None:
            return
        self._collect_drained()
        if time.monotonic() >= self._next_round_at:
            self._reconcile()

    def stop(self) -> None:
        import ray

        timeout_s = self.config.cluster.stop_timeout_s
        self.gateway.stop()
        stops = [h.stopping or h.actor.stop.remote(timeout_s) for h in self.instances.values()]
        try:
            ray.get(stops, timeout=timeout_s + 5)
        except Exception as e:  # an actor that is restarting cannot answer; kill it anyway
            log.warning("some instances did not stop cleanly: %s", e)
        for handle in self.instances.values():
            ray.kill(handle.actor, no_restart=True)
            _remove_group(handle)
        self.instances.clear()
        if self._reconciler is not None:
            self._reconciler.link.close()
            self._reconciler = None
        if self._started_ray:
            ray.shutdown()

    def run_forever(self, should_stop: Any, interval_s: float = 0.5) -> None:
        while not should_stop():
            self.poll()
            time.sleep(interval_s)


def _remove_group(handle: InstanceHandle) -> None:
    if handle.group is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(handle.group)
        handle.group = None
