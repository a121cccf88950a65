"""Deployments: the desired state launchers reconcile, instances of name@version in pools.

Every deployment is pooled: one `PoolSize` per (role, pool). `strata up --replicas N` and a
release write one mixed pool of N (`Deployment(name, version, N)` is that shorthand);
`strata up --prefill N --decode M` writes a prefill and a decode pool; a class pool
(`--class-pool interactive=fast`) is a mixed pool named `fast`. `replicas` is derived: the sum
of the pools. Each pool is reconciled, and sized by the autoscaler, on its own
(strata/cluster/deployments.py, strata/autoscale/controller.py). A record written before pools
existed (no `pools`) reads as one mixed pool of its `replicas`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from strata.errors import ConfigError

MIXED, DEFAULT_POOL = "mixed", "default"
ROLES = ("mixed", "prefill", "decode")


class DeploymentState(StrEnum):
    ACTIVE = "active"  # keep `replicas` instances running
    RETIRING = "retiring"  # drain every instance, start none; deleted once none is left


@dataclass(frozen=True, slots=True)
class PoolSize:
    """`replicas` instances of one role in one routing pool (`strata serve --role --pool`)."""

    role: str = MIXED
    pool: str = DEFAULT_POOL
    replicas: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"a pool's role is one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.pool or self.replicas < 0:
            raise ConfigError(f"a pool needs a name and replicas >= 0: {self}")

    @property
    def label(self) -> str:
        """How flags, logs and metrics name it: `prefill`, `decode`, `fast`, `decode.fast`;
        `mixed` for the default pool of mixed instances."""
        if self.pool == DEFAULT_POOL:
            return self.role
        return self.pool if self.role == MIXED else f"{self.role}.{self.pool}"

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "pool": self.pool, "replicas": self.replicas}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PoolSize:
        return cls(str(data["role"]), str(data["pool"]), int(data["replicas"]))


@dataclass(frozen=True, slots=True)
class Deployment:
    """Desired state: the instances of name@version, pool by pool. Launchers reconcile toward
    it. Built with `replicas` and no `pools`, it is one mixed pool of `replicas`; built with
    `pools`, `replicas` is their sum (a `replicas` given too must agree)."""

    name: str
    version: str
    replicas: int = 0
    state: DeploymentState = DeploymentState.ACTIVE
    revision: int = 0
    updated_at: float = 0.0
    pools: tuple[PoolSize, ...] = ()

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ConfigError(f"replicas must be >= 0, got {self.replicas}")
        if not self.pools:
            object.__setattr__(self, "pools", (PoolSize(MIXED, DEFAULT_POOL, self.replicas),))
        labels = [p.label for p in self.pools]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"{self.key}: two pools of one role and name: {labels}")
        total = sum(p.replicas for p in self.pools)
        if self.replicas and self.replicas != total:
            sizes = ", ".join(f"{p.label}={p.replicas}" for p in self.pools)
            raise ConfigError(f"{self.key}: replicas ({self.replicas}) must be the sum of its "
                              f"pools' ({sizes})")
        object.__setattr__(self, "replicas", total)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    def with_pool_sizes(self, sizes: Iterable[PoolSize]) -> Deployment:
        """The same deployment with these pools."""
        return replace(self, replicas=0, pools=tuple(sizes))

    def resized(self, replicas: int) -> Deployment:
        """The same deployment as one mixed pool of `replicas`."""
        return replace(self, replicas=replicas, pools=())

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "replicas": self.replicas,
                "state": self.state.value, "revision": self.revision,
                "updated_at": self.updated_at, "pools": [p.to_json() for p in self.pools]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Deployment:
        return cls(name=str(data["name"]), version=str(data["version"]),
                   replicas=int(data["replicas"]), state=DeploymentState(data["state"]),
                   revision=int(data.get("revision", 0)),
                   updated_at=float(data.get("updated_at", 0.0)),
                   pools=tuple(PoolSize.from_json(p) for p in data.get("pools") or ()))


__all__ = ["DEFAULT_POOL", "MIXED", "ROLES", "Deployment", "DeploymentState", "PoolSize"]
