"""The capacity planner: the real scheduler, prefix cache and routing policies over a fitted
latency profile, on a virtual clock (`strata plan`).

    workload.py   the workload (jobs, turns, shared prefixes, sessions) and the SLO
    arch.py       the architectures: one step of the evolution each, sized by the search
    instance.py   one simulated instance: the real Engine over a non-sleeping executor
    modelled.py   an instance as the capacity model sees it (hours of traffic in seconds)
    fleet.py      the discrete-event simulation of one architecture
    routing.py    the gateway's part: the real policies, in-flight accounting, the KV store
    watch.py      stopping a run once its SLO is surely missed
    autoscaled.py the real scaling law deciding over a simulated fleet (also the law's stories)
    costs.py      what a plan charges outside engine steps (overheads, KV transfer)
    outcome.py    percentiles, throughput, the SLO check and the bottleneck
    search.py     sizing each family to the SLO; the cheapest configuration
    report.py     the table and the JSON
"""

from __future__ import annotations

from strata.plan.arch import Architecture, Family, families
from strata.plan.costs import Costs
from strata.plan.instance import EngineShape, TensorParallel
from strata.plan.outcome import Outcome
from strata.plan.search import Plan, PlanInputs, plan, simulate
from strata.plan.workload import LengthDist, Slo, Workload, workload_from_bench_report

__all__ = ["Architecture", "Costs", "EngineShape", "Family", "LengthDist", "Outcome", "Plan",
           "PlanInputs", "Slo", "TensorParallel", "Workload", "families", "plan", "simulate",
           "workload_from_bench_report"]
