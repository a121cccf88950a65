"""Instance records: who serves what, where, in which state, under how much load.

Records cross process boundaries as JSON only (`to_json` / `from_json`); never pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from strata.errors import ConfigError
from strata.protocol.lora import AdapterResidency, residency_of


class Role(StrEnum):
    """What part of a request an instance serves."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class InstanceState(StrEnum):
    """starting -> ready -> draining -> deregistered; DEAD: the heartbeat is older than the TTL."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """The load an instance last reported."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_in_flight: int = 0  # HTTP-level requests not finished yet
    adapters: tuple[AdapterResidency, ...] = ()  # the LoRA adapters it knows (protocol/lora.py)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"num_running": self.num_running, "num_waiting": self.num_waiting,
                                "kv_usage": self.kv_usage, "num_in_flight": self.num_in_flight}
        if self.adapters:
            body["adapters"] = [adapter.to_json() for adapter in self.adapters]
        return body

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InstanceLoad:
        return cls(num_running=int(data.get("num_running", 0)),
                   num_waiting=int(data.get("num_waiting", 0)),
                   kv_usage=float(data.get("kv_usage", 0.0)),
                   num_in_flight=int(data.get("num_in_flight", 0)),
                   adapters=residency_of(data.get("adapters")))


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One rank of a parallel instance (tensor / pipeline parallel): where it runs and the bytes
    of weights and KV cache it holds."""

    rank: int
    host: str
    pid: int
    weight_bytes: int
    kv_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": self.pid,
                "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankInfo:
        return cls(rank=int(data["rank"]), host=str(data.get("host", "")),
                   pid=int(data.get("pid", 0)), weight_bytes=int(data.get("weight_bytes", 0)),
                   kv_bytes=int(data.get("kv_bytes", 0)))


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """One instance as the registry knows it."""

    instance_id: str
    url: str
    model: str
    version: str = "default"
    role: Role = Role.MIXED
    pool: str = "default"
    state: InstanceState = InstanceState.STARTING
    load: InstanceLoad = field(default_factory=InstanceLoad)
    last_heartbeat: float = 0.0  # seconds, on the registry's clock
    simulated: bool = False
    layout: str = "tp1"  # tensor x pipeline parallel: tp1, tp2, pp2, tp2xpp2
    ranks: tuple[RankInfo, ...] = ()  # of a parallel instance, in rank order
    node: str = ""  # the machine it runs on: its Ray node's address, else the host name
    deterministic: bool = False  # `strata serve --deterministic`: tokens independent of batch

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise ConfigError("instance_id must not be empty; pass --instance-id")
        if not self.url:
            raise ConfigError("url must not be empty; pass --advertise-url")

    @property
    def model_version(self) -> str:
        return f"{self.model}@{self.version}"

    def with_state(self, state: InstanceState) -> InstanceRecord:
        return replace(self, state=state)

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict (str/float/int/bool/dict only)."""
        return {"instance_id": self.instance_id, "url": self.url, "model": self.model,
                "version": self.version, "role": self.role.value, "pool": self.pool,
                "state": self.state.value, "load": self.load.to_json(),
                "last_heartbeat": self.last_heartbeat, "simulated": self.simulated,
                "layout": self.layout, "ranks": [r.to_json() for r in self.ranks],
                "node": self.node, "deterministic": self.deterministic}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InstanceRecord:
        """The inverse of `to_json`; unknown keys are ignored (newer writers)."""
        return cls(instance_id=str(data["instance_id"]), url=str(data["url"]),
                   model=str(data["model"]), version=str(data.get("version", "default")),
                   role=Role(data.get("role", Role.MIXED.value)),
                   pool=str(data.get("pool", "default")),
                   state=InstanceState(data.get("state", InstanceState.STARTING.value)),
                   load=InstanceLoad.from_json(data.get("load") or {}),
                   last_heartbeat=float(data.get("last_heartbeat", 0.0)),
                   simulated=bool(data.get("simulated", False)),
                   layout=str(data.get("layout", "tp1")),
                   ranks=tuple(RankInfo.from_json(r) for r in data.get("ranks") or ()),
                   node=str(data.get("node", "")),
                   deterministic=bool(data.get("deterministic", False)))


__all__ = ["InstanceLoad", "InstanceRecord", "InstanceState", "RankInfo", "Role"]
