"""Deployments: the desired state launchers reconcile, N instances of name@version, in pools.

    unpooled   `replicas` mixed instances of the default pool (`pools` empty): what `strata up
               --replicas N` and a release write
    pooled     one `PoolSize` per (role, pool): `strata up --prefill N --decode M` writes a
               prefill and a decode pool; a class pool (`--class-pool interactive=fast`) is a
               mixed pool named `fast`. `replicas` is their sum. Each pool is reconciled, and
               sized by the autoscaler, on its own (strata/cluster/deployments.py,
               strata/autoscale/controller.py)
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
    """Desired state: `replicas` instances of name@version (in `pools`, when it has some).
    Launchers reconcile toward it."""

    name: str
    version: str
    replicas: int
    state: DeploymentState = DeploymentState.ACTIVE
    revision: int = 0
    updated_at: float = 0.0
    pools: tuple[PoolSize, ...] = ()

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ConfigError(f"replicas must be >= 0, got {self.replicas}")
        labels = [p.label for p in self.pools]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"{self.key}: two pools of one role and name: {labels}")
        if self.pools and self.replicas != sum(p.replicas for p in self.pools):
            sizes = ", ".join(f"{p.label}={p.replicas}" for p in self.pools)
            raise ConfigError(f"{self.key}: replicas ({self.replicas}) must be the sum of its "
                              f"pools' ({sizes})")

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def pool_sizes(self) -> tuple[PoolSize, ...]:
        """Its pools; an unpooled deployment is one mixed pool of `replicas`."""
        return self.pools or (PoolSize(MIXED, DEFAULT_POOL, self.replicas),)

    def with_pool_sizes(self, sizes: Iterable[PoolSize]) -> Deployment:
        """The same deployment with these pool sizes (one mixed default pool stays unpooled)."""
        sizes = tuple(sizes)
        total = sum(p.replicas for p in sizes)
        if not self.pools and [p.label for p in sizes] == [MIXED]:
            return replace(self, replicas=total)
        return replace(self, replicas=total, pools=sizes)

    def to_json(self) -> dict[str, Any]:
        data = {"name": self.name, "version": self.version, "replicas": self.replicas,
                "state": self.state.value, "revision": self.revision,
                "updated_at": self.updated_at}
        return data | ({"pools": [p.to_json() for p in self.pools]} if self.pools else {})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Deployment:
        return cls(name=str(data["name"]), version=str(data["version"]),
                   replicas=int(data["replicas"]), state=DeploymentState(data["state"]),
                   revision=int(data.get("revision", 0)),
                   updated_at=float(data.get("updated_at", 0.0)),
                   pools=tuple(PoolSize.from_json(p) for p in data.get("pools") or ()))


__all__ = ["DEFAULT_POOL", "MIXED", "ROLES", "Deployment", "DeploymentState", "PoolSize"]
