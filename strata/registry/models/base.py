"""The control plane's records: model versions, routing pointers, deployments and releases.

    ModelVersion   name@version -> where its weights are (URI) and their manifest hash; an
                   adapter version names its `base` model (a LoRA adapter: its files' sha256)
    ModelRouting   per model: the `live` version, the `previous` one (rollback), a weighted canary
    Deployment     desired state the launcher reconciles: N instances of name@version
    Release        the state machine of one release, stored so that any controller can resume it

    ModelRegistry (Protocol)   async; memory, sqlite and redis implement it (one contract suite)

Every mutable record carries a `revision`; writers pass the revision they read and the backend
writes only if it is still current (compare-and-set), storing revision + 1. Revision 0 means
"absent": `expected_revision=0` creates. So a flip of the live pointer is one atomic write that
every gateway sees whole, and two controllers can never both advance one release.

Records cross process boundaries as JSON only (`to_json` / `from_json`); never pickle.

Release states (a release is driven by exactly one controller at a time, the lease holder):

    pending -> starting -> warming -> [canary ->] flipping -> retiring -> done
                   \\          \\          \\              \\          \\
                    +----------+----------+--------------+----------+--> rolling_back
                    (any failure before the flip; a rollback asked for at any step) |
                                                                         rolled_back <+
    `failed` is terminal for a release that could not even roll back cleanly (reason says why).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from strata.clock import Clock
from strata.errors import ConfigError, ConflictError
from strata.registry.models.deployments import Deployment, DeploymentState, PoolSize
from strata.registry.models.views import ViewBoard
from strata.registry.releases.health import HealthBoard


def split_model_version(text: str) -> tuple[str, str | None]:
    """"name@version" -> (name, version); "name" -> (name, None). Raises on empty parts."""
    name, sep, version = text.partition("@")
    if not name or (sep and not version):
        raise ConfigError(f"expected NAME or NAME@VERSION, got {text!r}")
    return name, (version if sep else None)


@dataclass(frozen=True, slots=True)
class ModelVersion:
    """One immutable version of a model. `uri`: a local path, file://, s3://, a default-model
    name, or `sim:PROFILE` (a simulated instance). `manifest_sha256`: the sha256 of the weights'
    manifest when registered ("" when the URI has none). `base`: for a LoRA adapter version,
    the base model it runs on ("" for a model); its `manifest_sha256` is then the adapter's
    digest (strata/protocol/lora.py) and its instances' name for it is `key` (adapter@version),
    so that no instance ever answers for one version with another's weights."""

    name: str
    version: str
    uri: str
    manifest_sha256: str = ""
    serve_args: tuple[str, ...] = ()  # extra `strata serve` flags for this version's instances
    created_at: float = 0.0
    base: str = ""  # a LoRA adapter version: the base model's name

    def __post_init__(self) -> None:
        for part in ("name", "version", "uri"):
            if not getattr(self, part):
                raise ConfigError(f"a model version needs a non-empty {part}")
        if "@" in self.name or "@" in self.version:
            raise ConfigError(f"'@' separates name and version; got {self.name!r}@{self.version!r}")

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def is_simulated(self) -> bool:
        return self.uri.startswith("sim:")

    @property
    def is_adapter(self) -> bool:
        return bool(self.base)

    def to_json(self) -> dict[str, Any]:
        body = {"name": self.name, "version": self.version, "uri": self.uri,
                "manifest_sha256": self.manifest_sha256, "serve_args": list(self.serve_args),
                "created_at": self.created_at}
        return body | {"base": self.base} if self.base else body

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelVersion:
        return cls(name=str(data["name"]), version=str(data["version"]), uri=str(data["uri"]),
                   manifest_sha256=str(data.get("manifest_sha256", "")),
                   serve_args=tuple(str(a) for a in data.get("serve_args", ())),
                   created_at=float(data.get("created_at", 0.0)),
                   base=str(data.get("base") or ""))


@dataclass(frozen=True, slots=True)
class ModelRouting:
    """Where a model's new traffic goes. `canary_weight` (0..1) of new sessions and requests go
    to `canary` when it is set; the rest to `live`."""

    name: str
    live: str | None = None
    previous: str | None = None
    canary: str | None = None
    canary_weight: float = 0.0
    revision: int = 0
    updated_at: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.canary_weight <= 1.0:
            raise ConfigError(f"canary weight must be in [0, 1], got {self.canary_weight}")

    def flipped_to(self, version: str) -> ModelRouting:
        """`version` live, the current live kept as `previous`, no canary."""
        previous = self.live if self.live != version else self.previous
        return replace(self, live=version, previous=previous, canary=None, canary_weight=0.0)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "live": self.live, "previous": self.previous,
                "canary": self.canary, "canary_weight": self.canary_weight,
                "revision": self.revision, "updated_at": self.updated_at}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelRouting:
        def opt(key: str) -> str | None:
            value = data.get(key)
            return None if value is None else str(value)

        return cls(name=str(data["name"]), live=opt("live"), previous=opt("previous"),
                   canary=opt("canary"), canary_weight=float(data.get("canary_weight", 0.0)),
                   revision=int(data.get("revision", 0)),
                   updated_at=float(data.get("updated_at", 0.0)))


class Strategy(StrEnum):
    BLUE_GREEN = "blue-green"
    CANARY = "canary"


class ReleaseState(StrEnum):
    PENDING = "pending"
    STARTING = "starting"  # the new deployment is written; instances are starting
    WARMING = "warming"  # every new instance is ready; each gets one real request
    CANARY = "canary"  # a weighted share goes to the new version while it is watched
    FLIPPING = "flipping"  # the live pointer is being flipped
    RETIRING = "retiring"  # live flipped; the old version drains and retires
    DONE = "done"
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (ReleaseState.DONE, ReleaseState.ROLLED_BACK, ReleaseState.FAILED)


@dataclass(frozen=True, slots=True)
class Release:
    """One release of name@to_version, replacing from_version (None: the model's first)."""

    release_id: str
    name: str
    to_version: str
    from_version: str | None
    strategy: Strategy = Strategy.BLUE_GREEN
    canary_weight: float = 0.1
    replicas: int = 1
    state: ReleaseState = ReleaseState.PENDING
    reason: str = ""  # why it rolled back or failed
    history: tuple[tuple[str, float], ...] = ()  # (state, time entered), oldest first
    owner: str = ""  # the controller holding the lease ("" = none)
    lease_until: float = 0.0
    revision: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)  # e.g. ready_to_flip_s
    base: str = ""  # a LoRA adapter's release: its base model (loaded on its instances)

    @property
    def is_terminal(self) -> bool:
        return self.state.is_terminal

    @property
    def is_adapter(self) -> bool:
        return bool(self.base)

    def moved_to(self, state: ReleaseState, now: float, reason: str = "") -> Release:
        return replace(self, state=state, reason=reason or self.reason,
                       history=(*self.history, (state.value, now)), updated_at=now)

    def to_json(self) -> dict[str, Any]:
        body = {"release_id": self.release_id, "name": self.name,
                "to_version": self.to_version, "from_version": self.from_version,
                "strategy": self.strategy.value, "canary_weight": self.canary_weight,
                "replicas": self.replicas, "state": self.state.value, "reason": self.reason,
                "history": [list(h) for h in self.history], "owner": self.owner,
                "lease_until": self.lease_until, "revision": self.revision,
                "created_at": self.created_at, "updated_at": self.updated_at,
                "stats": dict(self.stats)}
        return body | {"base": self.base} if self.base else body

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Release:
        from_version = data.get("from_version")
        return cls(release_id=str(data["release_id"]), name=str(data["name"]),
                   to_version=str(data["to_version"]),
                   from_version=None if from_version is None else str(from_version),
                   strategy=Strategy(data.get("strategy", Strategy.BLUE_GREEN.value)),
                   canary_weight=float(data.get("canary_weight", 0.1)),
                   replicas=int(data.get("replicas", 1)),
                   state=ReleaseState(data.get("state", ReleaseState.PENDING.value)),
                   reason=str(data.get("reason", "")),
                   history=tuple((str(s), float(t)) for s, t in data.get("history", ())),
                   owner=str(data.get("owner", "")),
                   lease_until=float(data.get("lease_until", 0.0)),
                   revision=int(data.get("revision", 0)),
                   created_at=float(data.get("created_at", 0.0)),
                   updated_at=float(data.get("updated_at", 0.0)),
                   stats={str(k): float(v) for k, v in (data.get("stats") or {}).items()},
                   base=str(data.get("base") or ""))


@dataclass(frozen=True, slots=True)
class ModelRegistryOptions:
    """What `create_model_registry` hands every backend's `from_url`: `clock` stamps
    created_at / updated_at."""

    clock: Clock = time.time


@runtime_checkable
class ModelRegistry(HealthBoard, ViewBoard, Protocol):
    """Models, versions, routing pointers, deployments, releases, the gateways' health
    windows (HealthBoard, registry/releases/health.py) and their routing views (ViewBoard,
    registry/models/views.py).

    Contract (tests/registry/test_models_contract.py runs it on every backend):
    - `add_version` stores an immutable version; adding an identical record again is a no-op,
      a different record under the same name@version raises ConflictError.
    - `set_routing`, `put_deployment` and `put_release` are compare-and-set on `revision`
      (0 = must not exist yet); they return the stored record (revision + 1, updated_at = now)
      and raise ConflictError when the stored revision differs. Racing writers: exactly one wins.
    - `put_release` with expected_revision=0 also raises ConflictError while another release of
      the same model is not terminal (one release per model at a time).
    - `prune_releases(name, keep=N)` deletes the terminal releases of `name` but the newest N
      (by created_at, release_id) and returns how many it deleted; it never touches one in
      progress.
    - Lists are sorted: versions by (name, created_at, version), routings by name, deployments
      by key, releases by (created_at, release_id).
    """

    async def add_version(self, version: ModelVersion) -> ModelVersion: ...

    async def get_version(self, name: str, version: str) -> ModelVersion | None: ...

    async def list_versions(self, name: str | None = None) -> list[ModelVersion]: ...

    async def get_routing(self, name: str) -> ModelRouting | None: ...

    async def list_routing(self) -> list[ModelRouting]: ...

    async def set_routing(self, routing: ModelRouting, *,
                          expected_revision: int) -> ModelRouting: ...

    async def put_deployment(self, deployment: Deployment, *,
                             expected_revision: int) -> Deployment: ...

    async def delete_deployment(self, name: str, version: str, *,
                                expected_revision: int | None = None) -> bool:
        """Delete name@version (idempotent); with `expected_revision`, only while the stored
        record is still at that revision. True when a record was deleted."""
        ...

    async def list_deployments(self) -> list[Deployment]: ...

    async def put_release(self, release: Release, *, expected_revision: int) -> Release: ...

    async def get_release(self, release_id: str) -> Release | None: ...

    async def list_releases(self, name: str | None = None) -> list[Release]: ...

    async def prune_releases(self, name: str, *, keep: int) -> int: ...

    async def close(self) -> None: ...


__all__ = ["ConflictError", "Deployment", "DeploymentState", "ModelRegistry",
           "ModelRegistryOptions", "ModelRouting", "ModelVersion", "PoolSize", "Release",
           "ReleaseState", "Strategy", "split_model_version"]
