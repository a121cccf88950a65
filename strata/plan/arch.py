"""The architectures `strata plan` compares, one step of the evolution each.

An `Architecture` is what one simulation runs; a `Family` is an architecture with its size left
open (replicas, or the P/D pair count), which the search sizes to the SLO. Cost is ranks: the
processes (cores, or chips) paid for, an instance of tensor parallel T counting T.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata.errors import ConfigError
from strata.gateway.routing.policies import policy_names, policy_row
from strata.plan.workload import Workload

SESSION_MODES = ("external", "sticky", "hybrid")


@dataclass(frozen=True, slots=True)
class Architecture:
    step: str  # the evolution step: one process, replicas, sessions, KV offload, P/D, TP, ...
    replicas: int = 1  # instances (decode instances under a P/D split)
    policy: str = "power_of_two"
    sessions: str | None = None  # external, sticky, hybrid (multi-turn workloads only)
    kv_offload: bool = False
    num_prefill: int = 0  # > 0: a P/D split with this many prefill instances
    tp: int = 1
    autoscale: bool = False  # replicas is then the most the autoscaler may run

    def __post_init__(self) -> None:
        if self.policy not in policy_names():
            raise ConfigError(f"unknown routing policy {self.policy!r}; valid policies: "
                              f"{', '.join(policy_names())}")
        if self.sessions is not None and self.sessions not in SESSION_MODES:
            raise ConfigError(f"sessions is one of {SESSION_MODES}, got {self.sessions!r}")
        if self.replicas < 1 or self.tp < 1 or self.num_prefill < 0:
            raise ConfigError("an architecture needs >= 1 replica, tp >= 1, prefill >= 0")

    @property
    def num_instances(self) -> int:
        return self.replicas + self.num_prefill

    @property
    def ranks(self) -> int:
        return self.num_instances * self.tp

    @property
    def label(self) -> str:
        if self.autoscale:
            return f"autoscaled 1..{self.replicas}, {self.policy}"
        if self.num_prefill:
            return f"P/D {self.num_prefill}P+{self.replicas}D, {self.policy}"
        parts = [f"{self.replicas}x" + (f" TP{self.tp}" if self.tp > 1 else "")]
        if self.step != "one process":
            parts.append(self.policy)
        if self.sessions:
            parts.append(f"sessions {self.sessions}")
        elif self.kv_offload:
            parts.append("KV offload")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Family:
    """An architecture sized by `unit`: replicas (and prefill instances) are multiples of it."""

    base: Architecture
    num_prefill_per_unit: int = 0
    num_decode_per_unit: int = 1

    def sized(self, units: int) -> Architecture:
        if self.base.autoscale:
            return self.base
        return replace(self.base, replicas=self.num_decode_per_unit * units,
                       num_prefill=self.num_prefill_per_unit * units)

    def max_units(self, max_ranks: int) -> int:
        per_unit = (self.num_prefill_per_unit + self.num_decode_per_unit) * self.base.tp
        return max(1, max_ranks // per_unit)


def workload_traits(workload: Workload) -> set[str]:
    """What a policy row's `wants` is matched against (strata/gateway/routing/policies)."""
    traits = set()
    if workload.has_sessions:
        traits.add("sessions")
    if workload.prefix_tokens or workload.has_sessions:  # a history re-read is a prefix too
        traits.add("prefix")
    return traits


def replica_policies(workload: Workload) -> list[str]:
    """Every row of the policy table meant for `workload`, in table order: a policy added to
    the table is planned with no other edit."""
    traits = workload_traits(workload)
    return [name for name in policy_names() if policy_row(name).applies_to(traits)]


def families(workload: Workload, *, max_ranks: int, tp_sizes: tuple[int, ...] = (2, 4),
             pd_ratios: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (1, 3), (2, 1)),
             ) -> list[Family]:
    """Every step of the evolution that applies to `workload`, in the evolution's order."""
    out = [Family(Architecture("one process", policy="round_robin"))]
    sessions_policy = {"external": "power_of_two", "sticky": "consistent_hash",
                       "hybrid": "consistent_hash"}
    out += [Family(Architecture("replicas", policy=p)) for p in replica_policies(workload)]
    if workload.has_sessions:
        out += [Family(Architecture("sessions", policy=sessions_policy[mode], sessions=mode,
                                    kv_offload=mode == "hybrid")) for mode in SESSION_MODES]
    out.append(Family(Architecture("KV offload", kv_offload=True)))
    best = "consistent_hash" if workload.has_sessions else "power_of_two"
    out += [Family(Architecture("P/D", policy="least_load"), p, d) for p, d in pd_ratios]
    out += [Family(Architecture("tensor parallel", policy=best, tp=t)) for t in tp_sizes]
    out.append(Family(Architecture("autoscaled", policy=best, autoscale=True,
                                   replicas=max_ranks)))
    return out


__all__ = ["SESSION_MODES", "Architecture", "Family", "families", "replica_policies",
           "workload_traits"]
