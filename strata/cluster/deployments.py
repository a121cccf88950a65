"""Reconcile a launcher's instances toward the deployments in the model registry.

The release controller never starts a process: it writes `Deployment` records (desired state)
and waits for instances to register. Each launcher (the local Supervisor, the Ray launcher)
runs rounds of the same pure plan over what it owns:

    ACTIVE   name@version, N replicas   keep instances {name}-{version}-0 .. N-1 (start missing
                                        ones; drain any of a higher index)
    ACTIVE   in pools                   per pool (role, pool name), keep its number of instances:
                                        start missing ones at the lowest free indices, drain
                                        the pool's highest; one pool's change never moves
                                        another's instances (each slot remembers its pool)
    RETIRING name@version               drain every instance, start none; once the launcher owns
                                        none of them, delete the deployment record
    no deployment                       an instance the launcher owns is drained

A draining instance (SIGTERM: in-flight requests finish, it deregisters, exits 0) is never
restarted, and its id is not reused until it has exited, so one id is never two processes.
An ACTIVE deployment whose version is not in the catalogue starts nothing (logged) and keeps
what it has: a missing catalogue entry is an operator's mistake, not a request to stop serving.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from strata.registry.models import Deployment, DeploymentState, ModelVersion
from strata.registry.models.deployments import DEFAULT_POOL, MIXED

# serve flags (each takes a value) that each version decides: the cluster-wide ones are dropped
VERSION_FLAGS = ("--simulate", "--model-version", "--served-model-name")
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def instance_id_of(name: str, version: str, index: int) -> str:
    """Unique across versions, stable across restarts of one child; safe in URLs and paths."""
    return _UNSAFE_ID_CHARS.sub("-", f"{name}-{version}-{index}")


@dataclass(frozen=True, slots=True)
class Slot:
    """One instance a launcher owns: which deployment it belongs to and whether it drains."""

    deployment: str  # name@version
    index: int
    is_draining: bool = False
    role: str = MIXED
    pool: str = DEFAULT_POOL


@dataclass(frozen=True, slots=True)
class Start:
    """An instance to start: index `index` of `version`, as `strata serve --role --pool`."""

    version: ModelVersion
    index: int
    role: str = MIXED
    pool: str = DEFAULT_POOL

    @property
    def slot(self) -> Slot:
        return Slot(self.version.key, self.index, role=self.role, pool=self.pool)


@dataclass(frozen=True, slots=True)
class Plan:
    """One round's actions, in order: start, drain, then delete finished deployments."""

    start: tuple[Start, ...] = ()
    drain: tuple[str, ...] = ()  # instance ids
    delete: tuple[Deployment, ...] = ()
    missing_versions: tuple[str, ...] = ()  # ACTIVE deployments not in the catalogue

    @property
    def is_empty(self) -> bool:
        return not (self.start or self.drain or self.delete)


def plan(deployments: Iterable[Deployment], versions: Mapping[str, ModelVersion],
         owned: Mapping[str, Slot]) -> Plan:
    """What to do so that `owned` (instance id -> slot) matches `deployments`."""
    deployments = list(deployments)
    kept: set[str] = set()  # instance ids of active deployments that stay
    starts: list[Start] = []
    for d in deployments:
        if d.state is DeploymentState.ACTIVE:
            pool_starts, drains = _pooled(d, versions.get(d.key), owned)
            starts += pool_starts
            kept |= {iid for iid, slot in owned.items()
                     if slot.deployment == d.key and iid not in drains}
    start = tuple(starts)
    drain = tuple(iid for iid, slot in owned.items()
                  if iid not in kept and not slot.is_draining)
    keys_owned = {slot.deployment for slot in owned.values()}
    delete = tuple(d for d in deployments
                   if d.state is DeploymentState.RETIRING and d.key not in keys_owned)
    missing = tuple(d.key for d in deployments
                    if d.state is DeploymentState.ACTIVE and d.key not in versions)
    return Plan(start, drain, delete, missing)


def _pooled(d: Deployment, version: ModelVersion | None,
            owned: Mapping[str, Slot]) -> tuple[list[Start], set[str]]:
    """(starts, drains) of an active deployment, pool by pool, in the order of its pools: a
    pool drains its highest indices; its new instances take the lowest indices no instance of
    the deployment holds (draining ones included: an id is never two processes). A slot of a
    pool the deployment no longer lists is drained."""
    mine = {iid: s for iid, s in owned.items() if s.deployment == d.key}
    free = _free_indices({s.index for s in mine.values()})
    starts: list[Start] = []
    drains = {iid for iid, s in mine.items()
              if not s.is_draining and (s.role, s.pool) not in {(p.role, p.pool) for p in d.pools}}
    for p in d.pools:
        live = sorted((s.index, iid) for iid, s in mine.items()
                      if not s.is_draining and (s.role, s.pool) == (p.role, p.pool))
        drains |= {iid for _, iid in live[p.replicas:]}
        if version is not None:
            starts += [Start(version, next(free), p.role, p.pool)
                       for _ in range(p.replicas - len(live))]
    return starts, drains


def _free_indices(taken: set[int]) -> Iterator[int]:
    index = 0
    while True:
        if index not in taken:
            yield index
        index += 1


def serve_model_args(version: ModelVersion, cluster_serve_args: Iterable[str]) -> list[str]:
    """The `strata serve` arguments that say which model and version an instance serves: the
    model (or `--simulate PROFILE` for a `sim:` URI), its name and version, then the
    cluster-wide flags (less the ones the version decides), then the version's own flags."""
    model = ["--simulate", version.uri[len("sim:"):]] if version.is_simulated else [version.uri]
    return [*model, "--served-model-name", version.name, "--model-version", version.version,
            *without_version_flags(cluster_serve_args), *version.serve_args]


def without_version_flags(args: Iterable[str]) -> list[str]:
    """`args` less VERSION_FLAGS and their values (`--flag VALUE` or `--flag=VALUE`)."""
    kept: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
        elif arg in VERSION_FLAGS:
            skip_value = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in VERSION_FLAGS)):
            kept.append(arg)
    return kept


__all__ = ["VERSION_FLAGS", "Plan", "Slot", "Start", "instance_id_of", "plan", "serve_model_args",
           "without_version_flags"]
