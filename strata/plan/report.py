"""A plan as a terminal table, and as JSON (`strata plan --json`)."""

from __future__ import annotations

from typing import Any

from strata.bench.report import json_safe
from strata.plan.outcome import Outcome
from strata.plan.search import Plan, PlanInputs

PLAN_FORMAT = 1


def plan_json(plan: Plan, *, measured: dict[str, Any] | None = None) -> dict[str, Any]:
    inputs = plan.inputs
    slo = inputs.slo
    return json_safe({
        "format": PLAN_FORMAT,
        "simulated": True,
        "profile": {"model": inputs.profile.model, "source": inputs.profile.source},
        "workload": inputs.workload.describe(),
        "slo": {"ttft_ms": slo.ttft_ms, "ttft_percentile": slo.ttft_percentile,
                "tpot_ms": slo.tpot_ms, "tpot_percentile": slo.tpot_percentile},
        "max_ranks": inputs.max_ranks,
        "session_consistency": inputs.costs.session_consistency,
        "configs": [row.to_json() for row in plan.rows],
        "best": plan.best.to_json() if plan.best else None,
        "ruled_out": [{"config": row.arch.label, "ranks": round(row.ranks, 2),
                       "bottleneck": row.bottleneck} for row in _cheaper(plan)],
        "measured": measured,
        "num_simulations": plan.num_simulations,
        "wall_s": round(plan.wall_s, 3),
    })


def _cheaper(plan: Plan) -> list[Outcome]:
    if plan.best is None:
        return [row for row in plan.rows if not row.meets_slo]
    return [row for row in plan.rows if row.ranks < plan.best.ranks and not row.meets_slo]


def _cell(stats: dict[str, float]) -> str:
    return "/".join(f"{stats[k]:.0f}" for k in ("p50", "p90", "p99"))


def _session_line(inputs: PlanInputs) -> list[str]:
    """What the session store's level costs a turn, for a multi-turn workload."""
    if inputs.workload.num_turns < 2:
        return []
    costs = inputs.costs
    if costs.session_consistency == "strong":
        what = f"a stored session's turn ends {costs.session_write_ms:g} ms later (written " \
               "before the answer)"
    else:
        what = "turns written behind the answer (a crash loses the unwritten ones)"
    return [f"sessions: {costs.session_consistency} consistency: {what}"]


def format_plan(plan: Plan) -> str:
    inputs, slo = plan.inputs, plan.inputs.slo
    w = inputs.workload
    load = f"{w.rate_per_s:g} req/s" if w.rate_per_s else f"concurrency {w.concurrency}"
    lines = [
        f"strata plan (SIMULATED: {inputs.profile.source})",
        f"workload: {w.num_requests} requests, {load}, prompt {w.prompt.low}-{w.prompt.high} "
        f"+ prefix {w.prefix_tokens} ({w.num_prefixes} distinct), output "
        f"{w.output.low}-{w.output.high}, {w.num_turns} turn(s) per session",
        f"SLO: TTFT p{slo.ttft_percentile:g} <= {slo.ttft_ms:g} ms, TPOT "
        f"p{slo.tpot_percentile:g} <= {slo.tpot_ms:g} ms",
        *_session_line(inputs),
        "",
        f"{'config':<40}{'ranks':>6}  {'TTFT p50/90/99 ms':<20}{'TPOT p50/90/99 ms':<19}"
        f"{'out tok/s':>10}{'hit':>5}  {'SLO':<4} bottleneck",
    ]
    for row in plan.rows:
        mark = "ok" if row.meets_slo else "miss"
        star = "*" if row is plan.best else " "
        lines.append(f"{star}{row.arch.label:<39}{row.ranks:>6.1f}  {_cell(row.ttft_ms):<20}"
                     f"{_cell(row.tpot_ms):<19}{row.output_tokens_per_s:>10.0f}"
                     f"{row.prefix_hit_rate:>5.0%}  {mark:<4} {row.bottleneck}")
    lines.append("")
    if plan.best is None:
        lines.append(f"no configuration within {inputs.max_ranks} ranks meets the SLO")
    else:
        lines.append(f"cheapest that meets the SLO: {plan.best.arch.label} "
                     f"({plan.best.ranks:.1f} ranks); a turn p50/90/99 "
                     f"{_cell(plan.best.turn_ms)} ms")
        for row in _cheaper(plan):
            lines.append(f"  ruled out: {row.arch.label} ({row.ranks:.1f}): {row.bottleneck}")
    lines.append(f"{plan.num_simulations} simulations in {plan.wall_s:.1f} s")
    return "\n".join(lines)


__all__ = ["PLAN_FORMAT", "format_plan", "plan_json"]
