"""What an autoscaler last decided, as the gateway's dashboard shows it (`to_json`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ScalingTarget:
    """One group the autoscaler sizes: how many instances it wants and how many run."""

    model: str
    version: str
    role: str
    pool: str
    desired: int
    actual: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AutoscalerStatus:
    """What an autoscaler last decided (who decided, when, and each group's target)."""

    decided_at: float
    owner: str
    targets: tuple[ScalingTarget, ...]

    def to_json(self) -> dict[str, Any]:
        return {"decided_at": self.decided_at, "owner": self.owner,
                "targets": [{"model": t.model, "version": t.version, "role": t.role,
                             "pool": t.pool, "desired": t.desired, "actual": t.actual,
                             "reason": t.reason} for t in self.targets]}


__all__ = ["AutoscalerStatus", "ScalingTarget"]
