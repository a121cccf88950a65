"""`plan`: simulate every family of architectures, each sized to the fewest units that meet
the SLO, and name the cheapest.

Sizing doubles the units from a start the offered load suggests (`work_hint`) until the SLO is
met or the rank budget is spent, then bisects between the last miss and the first hit; each
family shows its cheapest passing size and the size just below it, with the bottleneck that
rules that one out. A run that surely misses the SLO stops early (watch.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from strata.autoscale.capacity import CapacityModel
from strata.errors import ConfigError
from strata.plan.arch import Architecture, Family, families
from strata.plan.autoscaled import autoscale
from strata.plan.costs import Costs
from strata.plan.fleet import Fleet, FleetResult
from strata.plan.instance import EngineShape
from strata.plan.outcome import Outcome, diagnose, outcome
from strata.plan.watch import SloWatch
from strata.plan.workload import Slo, Workload
from strata.sim.profile import LatencyProfile


@dataclass(frozen=True, slots=True)
class PlanInputs:
    workload: Workload
    slo: Slo
    profile: LatencyProfile
    max_ranks: int = 64
    steps: tuple[str, ...] = ()  # only these evolution steps ("" = all)
    shape: EngineShape = field(default_factory=EngineShape)
    costs: Costs = field(default_factory=Costs)

    def __post_init__(self) -> None:
        if self.max_ranks < 1:
            raise ConfigError(f"the rank budget must be >= 1, got {self.max_ranks}")


@dataclass(slots=True)
class Plan:
    inputs: PlanInputs
    rows: list[Outcome]
    best: Outcome | None
    wall_s: float
    num_simulations: int


def simulate(arch: Architecture, inputs: PlanInputs, *,
             stop_early: bool = False) -> tuple[Outcome, FleetResult]:
    """One architecture over the workload on a virtual clock; with `stop_early`, only until
    the SLO is surely missed."""
    started = time.perf_counter()
    fleet = Fleet(arch, inputs.profile, inputs.workload, shape=inputs.shape, costs=inputs.costs)
    if stop_early:
        fleet.watch = SloWatch(inputs.slo, inputs.workload.num_requests)
    if arch.autoscale:
        autoscale(fleet, inputs.slo)
    run = fleet.run()
    out = outcome(arch, run, inputs.slo)
    out.wall_s = time.perf_counter() - started
    return out, run


def plan(inputs: PlanInputs) -> Plan:
    started = time.perf_counter()
    runs: dict[Architecture, tuple[Outcome, FleetResult]] = {}
    shown: list[Architecture] = []
    hint = start = work_hint(inputs)
    for family in _families(inputs):
        sizes = _size(family, inputs, hint if _is_plain(family) else start, runs)
        if _is_plain(family) and runs[sizes[-1]][0].meets_slo:
            hint = sizes[-1].num_instances  # the next family of replicas starts there
        shown += sizes
    best_hit = max((o.prefix_hit_rate for o, _ in runs.values()), default=0.0)
    rows = []
    for arch in dict.fromkeys(shown):
        out, run = runs[arch]
        out.bottleneck = diagnose(out, run, inputs.slo, inputs.workload, inputs.profile,
                                  best_hit) + (" [stopped early]" if out.is_stopped_early else "")
        rows.append(out)
    rows.sort(key=lambda o: (o.ranks, not o.meets_slo))
    passing = [o for o in rows if o.meets_slo]
    best = min(passing, key=lambda o: (o.ranks, o.ttft_ms["p90"])) if passing else None
    return Plan(inputs, rows, best, time.perf_counter() - started, len(runs))


def _families(inputs: PlanInputs) -> list[Family]:
    found = families(inputs.workload, max_ranks=inputs.max_ranks)
    if not inputs.steps:
        return [f for f in found if f.base.tp * (1 + f.num_prefill_per_unit) <= inputs.max_ranks]
    known = {f.base.step for f in found}
    unknown = [s for s in inputs.steps if s not in known]
    if unknown:
        steps = ", ".join(dict.fromkeys(f.base.step for f in found))
        raise ConfigError(f"unknown or inapplicable step(s) {', '.join(unknown)}; this "
                          f"workload's steps: {steps}")
    return [f for f in found if f.base.step in inputs.steps]


def _size(family: Family, inputs: PlanInputs, hint: int,
          runs: dict[Architecture, tuple[Outcome, FleetResult]]) -> list[Architecture]:
    """The sizes of `family` to show: the cheapest that meets the SLO and the one below it
    (or the largest tried, when none meets it). `hint`: instances to try first (the offered
    work's estimate, or what a like family needed); the search doubles from there, then tries
    one unit fewer than the first size that meets the SLO (usually the answer), then bisects."""
    def meets(units: int) -> bool:
        arch = family.sized(units)
        if arch not in runs:  # an autoscaled fleet misses while it grows: let it finish
            runs[arch] = simulate(arch, inputs, stop_early=not arch.autoscale)
        return runs[arch][0].meets_slo

    if family.base.autoscale or family.base.step == "one process":
        meets(1)
        return [family.sized(1)]
    top = family.max_units(inputs.max_ranks)
    # a family of plain replicas starts at 2: its size 1 is the one process, its own family
    base = 2 if _is_plain(family) else 1
    per_unit = family.num_prefill_per_unit + family.num_decode_per_unit
    low, high = base - 1, min(top, max(base, hint // per_unit))  # low: known to miss (or 0)
    while not meets(high):
        if high >= top:
            return [family.sized(high)]
        low, high = high, min(2 * high, top)
    if high - 1 > low:
        low, high = (low, high - 1) if meets(high - 1) else (high - 1, high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if meets(mid) else (mid, high)
    return [family.sized(u) for u in (low, high) if u >= base]


def _is_plain(family: Family) -> bool:
    """Replicas of one instance each (no P/D, no TP)."""
    return family.base.tp == 1 and family.num_prefill_per_unit == 0 \
        and family.base.step != "one process"


def work_hint(inputs: PlanInputs) -> int:
    """A power of two at most the instances the offered load needs at full use (the
    autoscaler's capacity model at the SLO's TPOT; prefix hits make the real need smaller,
    so this is only where the search starts). 1 for a closed loop."""
    w = inputs.workload
    if w.rate_per_s is None:
        return 1
    model = CapacityModel(inputs.profile, inputs.shape.max_num_seqs, inputs.slo.tpot_ms / 1000)
    need = w.rate_per_s / model.requests_per_s(w.prompt.mean, w.output.mean)
    return 1 << max(0, math.floor(math.log2(max(need, 1.0))))
