"""Autoscaling numbers: the real scaling law on a virtual clock, then a live `strata up` run.

    .venv/bin/python bench/autoscale.py [--skip-live]

Virtual clock (strata/plan/autoscaled.py: run_autoscaled, the planner's fleet of capacity-model
instances; the bundled smollm2-cpu profile, 200-token prompts,
100-token answers, instance start time S = 5 s, default law settings):
- a 1x -> 4x step: seconds to the first decision, seconds until TTFT p95 (by arrival second) is
  back under the SLO (1 s here) for good;
- from zero replicas: the first request's time to first token;
- an hour of steady load at three levels: the most direction changes in any 10 minutes;
- an hour of diurnal load with two bursts: instance-seconds against the offline oracle (every
  second, the fewest replicas that serve that second's rate at full use, started on time), for
  four settings of the target and down utilizations.
Live (`strata up --simulate --autoscale`, S = 5 s, the synthetic 8-slot profile of
tests/cluster/test_autoscale_e2e.py, streamed requests): a step 1x -> 4x and back, the first
decision (from the gateway's /metrics), client TTFT p95 per second, failed requests, and a start
from zero replicas. Writes .bench/results/autoscale.json and the plots in docs/img/.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from autoscale_live import live_results  # noqa: E402
from gateway_overhead import RESULTS, ROOT, load_average  # noqa: E402

from strata.autoscale.capacity import CapacityModel  # noqa: E402
from strata.autoscale.config import AutoscaleConfig  # noqa: E402
from strata.autoscale.law import UP, ScalingLaw  # noqa: E402
from strata.plan.autoscaled import AutoscaledRun, oracle_replicas, run_autoscaled  # noqa: E402
from strata.sim import load_profile  # noqa: E402

IMG = ROOT / "docs" / "img"
START_S = 5.0
PROFILE = load_profile("smollm2-cpu")


def make_law(**fields: Any) -> ScalingLaw:
    config = AutoscaleConfig(**{"min_replicas": 1, "max_replicas": 32, **fields})
    return ScalingLaw(config, CapacityModel(PROFILE, config.max_num_seqs, config.itl_slo_s))


def step_run() -> tuple[dict[str, Any], AutoscaledRun, Any]:
    law, step_at = make_law(ttft_slo_s=1.0), 120
    base = 0.8 * law.mu

    def rate(t: float) -> float:
        return base if t < step_at else 4 * base

    run = run_autoscaled(law, PROFILE, rate, 400, start_s=START_S)
    first = min(t for t, d in run.decisions if t >= step_at and d.direction == UP)
    p95 = run.ttft_p95_by_second()
    over = [t for t, v in p95.items() if t >= step_at and v > 1.0]
    before = [tick.desired for tick in run.ticks if tick.t < step_at]
    return {"first_decision_s": round(first - step_at, 2),
            "ttft_back_under_slo_s": (max(over) - step_at) if over else 0,
            "worst_ttft_p95_s": round(max(p95.values()), 2),
            "replicas": [before[-1], run.ticks[-1].desired]}, run, rate


def from_zero() -> dict[str, Any]:
    law = make_law(min_replicas=0)
    run = run_autoscaled(law, PROFILE, lambda t: 0.0 if t < 30 else 2.0, 120, start_s=START_S,
                         initial_replicas=0)
    arrival, ttft = min(run.ttfts)
    return {"first_token_s": round(ttft, 2), "first_decision": run.decisions[0][1].reason}


def steady() -> dict[str, Any]:
    out = {}
    for load in (0.7, 2.7, 6.3):
        law = make_law()
        run = run_autoscaled(law, PROFILE, lambda t, x=load * law.mu: x, 3600, start_s=START_S,
                             initial_replicas=math.ceil(load / 0.9), seed=int(load * 10))
        out[f"{load}x_capacity"] = max(run.direction_changes(s, s + 600)
                                       for s in range(0, 3600, 600))
    return out


def diurnal_rate(mu: float) -> Any:
    def rate(t: float) -> float:
        burst = 2.0 if 1200 <= t < 1260 or 2400 <= t < 2430 else 1.0
        return mu * (2.5 + 2.0 * math.sin(2 * math.pi * t / 3600)) * burst
    return rate


def diurnal() -> tuple[dict[str, Any], AutoscaledRun, Any, ScalingLaw]:
    rows: dict[str, Any] = {}
    kept: tuple[AutoscaledRun, Any, ScalingLaw] | None = None
    for target, down in ((0.8, 0.7), (0.85, 0.75), (0.9, 0.8), (0.95, 0.9)):
        law = make_law(target_utilization=target, down_utilization=down)
        rate = diurnal_rate(law.mu)
        started = time.perf_counter()
        run = run_autoscaled(law, PROFILE, rate, 3600, start_s=START_S, initial_replicas=3,
                             seed=1)
        wall_s = time.perf_counter() - started
        cost = run.fleet.instance_seconds
        oracle = sum(oracle_replicas(rate(t), law) for t in range(3600))
        ideal = sum(math.ceil(rate(t) / law.mu / target - 0.05) for t in range(3600))
        rows[f"{target}/{down}"] = {
            "instance_seconds": round(cost), "oracle": oracle,
            "ratio": round(cost / oracle, 3),
            "instant_law_ratio": round(ideal / oracle, 3),
            "seconds_over_slo": sum(1 for v in run.ttft_p95_by_second().values()
                                    if v > law.config.ttft_slo_s),
            "direction_changes": run.direction_changes(), "requests": run.num_requests,
            "wall_s": round(wall_s, 2)}
        if (target, down) == (0.9, 0.8):
            kept = (run, rate, law)
    assert kept is not None
    return rows, *kept


def plot_virtual(step: tuple[AutoscaledRun, Any],
                 day: tuple[AutoscaledRun, Any, ScalingLaw]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, rate = step
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    t = list(range(90, 200))
    arrivals: dict[int, int] = {}
    for turn in run.fleet.turns:
        arrivals[int(turn.arrival_s)] = arrivals.get(int(turn.arrival_s), 0) + 1
    ticks = [tick for tick in run.ticks if 90 <= tick.t < 200]
    p95 = run.ttft_p95_by_second()
    axes[0].plot(t, [rate(x) for x in t], label="offered load (req/s)")
    axes[0].plot(t, [arrivals.get(x, 0) for x in t], ".", ms=3, label="arrivals per second")
    axes[1].step([k.t for k in ticks], [k.desired for k in ticks], where="post", label="desired")
    axes[1].step([k.t for k in ticks], [k.ready for k in ticks], where="post", label="ready")
    axes[2].plot(t, [p95.get(x) for x in t], label="TTFT p95 by arrival second (s)")
    axes[2].axhline(1.0, color="r", ls="--", lw=1, label="SLO")
    for ax, title in zip(axes, ("load", "replicas", "TTFT p95"), strict=True):
        ax.set_ylabel(title)
        ax.legend(loc="upper left", fontsize=8)
    axes[2].set_xlabel("virtual time (s); a 1x -> 4x step at 120 s, start time S = 5 s")
    fig.tight_layout()
    fig.savefig(IMG / "autoscale-step.png", dpi=110)
    run, rate, law = day
    fig, axes = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    t = [tick.t for tick in run.ticks]
    axes[0].plot(t, [rate(x) for x in t], lw=1, label="offered load (req/s)")
    axes[1].step(t, [tick.instances for tick in run.ticks], where="post", lw=1,
                 label="instances (paid for)")
    axes[1].step(t, [oracle_replicas(rate(x), law) for x in t], where="post", lw=1,
                 label="oracle")
    for ax in axes:
        ax.legend(loc="upper right", fontsize=8)
    axes[1].set_xlabel("virtual time (s): one hour of diurnal load with two bursts")
    fig.tight_layout()
    fig.savefig(IMG / "autoscale-diurnal.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-live", action="store_true")
    args = parser.parse_args()
    IMG.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    step, step_fleet, step_rate = step_run()
    rows, day_run, day_rate, day_law = diurnal()
    result: dict[str, Any] = {
        "load_average": load_average(),
        "virtual": {"step": step, "from_zero": from_zero(), "steady_max_changes_per_10min":
                    steady(), "diurnal": rows}}
    plot_virtual((step_fleet, step_rate), (day_run, day_rate, day_law))
    if not args.skip_live:
        result["live"] = live_results(IMG)
    result["load_average_after"] = load_average()
    (RESULTS / "autoscale.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
