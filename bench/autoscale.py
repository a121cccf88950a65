"""Autoscaling numbers: the real scaling law on a virtual clock, then a live `strata up` run.

    .venv/bin/python bench/autoscale.py [--skip-live]

Virtual clock (strata/autoscale/virtual.py; the bundled smollm2-cpu profile, 200-token prompts,
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
from strata.autoscale.virtual import FleetRun, VirtualFleet, oracle_replicas  # noqa: E402
from strata.sim import load_profile  # noqa: E402

IMG = ROOT / "docs" / "img"
START_S = 5.0


def make_law(**fields: Any) -> ScalingLaw:
    config = AutoscaleConfig(**{"min_replicas": 1, "max_replicas": 32, **fields})
    return ScalingLaw(config, CapacityModel(load_profile("smollm2-cpu"), config.max_num_seqs,
                                            config.itl_slo_s))


def step_run() -> tuple[dict[str, Any], FleetRun, Any]:
    law, step_at = make_law(ttft_slo_s=1.0), 120
    base = 0.8 * law.mu

    def rate(t: float) -> float:
        return base if t < step_at else 4 * base

    run = VirtualFleet(law, start_s=START_S).run(rate, 400)
    first = min(t for t, d in run.decisions if t >= step_at and d.direction == UP)
    over = [s.t for s in run.seconds if s.t > step_at and s.ttft_p95_s and s.ttft_p95_s > 1.0]
    return {"first_decision_s": round(first - step_at, 2),
            "ttft_back_under_slo_s": (max(over) - step_at) if over else 0,
            "worst_ttft_p95_s": round(max(s.ttft_p95_s or 0 for s in run.seconds), 2),
            "replicas": [run.seconds[step_at - 1].desired, run.seconds[-1].desired]}, run, rate


def from_zero() -> dict[str, Any]:
    law = make_law(min_replicas=0)
    run = VirtualFleet(law, start_s=START_S, initial_replicas=0).run(
        lambda t: 0.0 if t < 30 else 2.0, 120)
    arrival, ttft = min(run.ttfts)
    return {"first_token_s": round(ttft, 2), "first_decision": run.decisions[0][1].reason}


def steady() -> dict[str, Any]:
    out = {}
    for load in (0.7, 2.7, 6.3):
        law = make_law()
        run = VirtualFleet(law, start_s=START_S, initial_replicas=math.ceil(load / 0.9),
                           seed=int(load * 10)).run(lambda t, x=load * law.mu: x, 3600)
        out[f"{load}x_capacity"] = max(run.direction_changes(s, s + 600)
                                       for s in range(0, 3600, 600))
    return out


def diurnal_rate(mu: float) -> Any:
    def rate(t: float) -> float:
        burst = 2.0 if 1200 <= t < 1260 or 2400 <= t < 2430 else 1.0
        return mu * (2.5 + 2.0 * math.sin(2 * math.pi * t / 3600)) * burst
    return rate


def diurnal() -> tuple[dict[str, Any], FleetRun, Any, ScalingLaw]:
    rows: dict[str, Any] = {}
    kept: tuple[FleetRun, Any, ScalingLaw] | None = None
    for target, down in ((0.8, 0.7), (0.85, 0.75), (0.9, 0.8), (0.95, 0.9)):
        law = make_law(target_utilization=target, down_utilization=down)
        rate = diurnal_rate(law.mu)
        started = time.perf_counter()
        run = VirtualFleet(law, start_s=START_S, initial_replicas=3, seed=1).run(rate, 3600)
        wall_s = time.perf_counter() - started
        oracle = sum(oracle_replicas(rate(t), law) for t in range(3600))
        ideal = sum(math.ceil(rate(t) / law.mu / target - 0.05) for t in range(3600))
        rows[f"{target}/{down}"] = {
            "instance_seconds": round(run.instance_seconds), "oracle": oracle,
            "ratio": round(run.instance_seconds / oracle, 3),
            "instant_law_ratio": round(ideal / oracle, 3),
            "seconds_over_slo": sum(1 for s in run.seconds
                                    if s.ttft_p95_s and s.ttft_p95_s > law.config.ttft_slo_s),
            "direction_changes": run.direction_changes(), "requests": run.num_requests,
            "wall_s": round(wall_s, 2)}
        if (target, down) == (0.9, 0.8):
            kept = (run, rate, law)
    assert kept is not None
    return rows, *kept


def plot_virtual(step: tuple[FleetRun, Any], day: tuple[FleetRun, Any, ScalingLaw]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, rate = step
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    t = [s.t for s in run.seconds][90:200]
    secs = run.seconds[90:200]
    axes[0].plot(t, [rate(x - 1) for x in t], label="offered load (req/s)")
    axes[0].plot(t, [s.arrivals for s in secs], ".", ms=3, label="arrivals per second")
    axes[1].step(t, [s.desired for s in secs], where="post", label="desired")
    axes[1].step(t, [s.ready for s in secs], where="post", label="ready")
    axes[2].plot(t, [s.ttft_p95_s for s in secs], label="TTFT p95 by arrival second (s)")
    axes[2].axhline(1.0, color="r", ls="--", lw=1, label="SLO")
    for ax, title in zip(axes, ("load", "replicas", "TTFT p95"), strict=True):
        ax.set_ylabel(title)
        ax.legend(loc="upper left", fontsize=8)
    axes[2].set_xlabel("virtual time (s); a 1x -> 4x step at 120 s, start time S = 5 s")
    fig.tight_layout()
    fig.savefig(IMG / "autoscale-step.png", dpi=110)
    run, rate, law = day
    fig, axes = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    t = [s.t for s in run.seconds]
    axes[0].plot(t, [rate(x) for x in t], lw=1, label="offered load (req/s)")
    axes[1].step(t, [s.instances for s in run.seconds], where="post", lw=1,
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
