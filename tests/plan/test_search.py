"""Sizing to the SLO, with loads whose answer is derivable by hand."""

from __future__ import annotations

import pytest

from strata.errors import ConfigError
from strata.plan import (
    Architecture,
    Costs,
    EngineShape,
    LengthDist,
    PlanInputs,
    Slo,
    Workload,
    plan,
    simulate,
)
from strata.sim.profile import LatencyProfile

ONE_SLOT = EngineShape(max_num_seqs=1, max_num_batched_tokens=100)


def prefill_only(rate: float, n: int = 600) -> Workload:
    """Requests of one step each: 100 prompt tokens, 1 output token (S = 60 ms)."""
    return Workload(num_requests=n, rate_per_s=rate, prompt=LengthDist(100, 100),
                    output=LengthDist(1, 1))


def test_a_load_of_1_5_instances_needs_exactly_two_replicas(
        round_profile: LatencyProfile) -> None:
    """25 req/s x 60 ms = 1.5 instances of work: one instance is overloaded (rho 1.5, its
    queue grows without bound: its run stops once more than 10 % are over), two run at rho
    0.75 and meet a 500 ms TTFT p90."""
    inputs = PlanInputs(prefill_only(25.0), Slo(ttft_ms=500, tpot_ms=100), round_profile,
                        max_ranks=8, steps=("one process", "replicas"), shape=ONE_SLOT,
                        costs=Costs(request_overhead_ms=0.0))
    result = plan(inputs)
    assert result.best is not None
    assert result.best.ranks == 2
    assert result.best.arch.replicas == 2
    one = next(r for r in result.rows if r.arch.step == "one process")
    assert not one.meets_slo
    assert one.bottleneck.startswith("compute: instances 100% busy")
    assert one.is_stopped_early and one.bottleneck.endswith("[stopped early]")
    assert one.ttft_ms["p90"] > 500  # of the requests done when it stopped
    assert {r.arch.replicas for r in result.rows if r.arch.step == "replicas"} == {2}


def test_a_light_load_is_served_by_one_process(round_profile: LatencyProfile) -> None:
    inputs = PlanInputs(prefill_only(2.0, n=100), Slo(ttft_ms=500, tpot_ms=100),
                        round_profile, steps=("one process",), shape=ONE_SLOT)
    result = plan(inputs)
    assert result.best is not None and result.best.arch.step == "one process"
    assert result.num_simulations == 1


def test_a_prompt_too_long_for_the_ttft_bound_is_a_prefill_floor(
        round_profile: LatencyProfile) -> None:
    """1000 prompt tokens take 10 + 500 ms on an idle instance: no replica count meets 200 ms;
    TP 4 makes it 10 + 125 (+ 1.8 ms of all-reduces)."""
    workload = Workload(num_requests=20, concurrency=1, prompt=LengthDist(1000, 1000),
                        output=LengthDist(2, 2))
    inputs = PlanInputs(workload, Slo(ttft_ms=200, tpot_ms=100), round_profile, max_ranks=4,
                        steps=("one process", "replicas", "tensor parallel"))
    result = plan(inputs)
    one = next(r for r in result.rows if r.arch.step == "one process")
    assert one.bottleneck.startswith("prefill floor")
    assert result.best is not None and result.best.arch.tp == 4


def test_unknown_steps_are_refused_with_the_valid_ones(round_profile: LatencyProfile) -> None:
    inputs = PlanInputs(prefill_only(2.0), Slo(500, 100), round_profile, steps=("sessions",))
    with pytest.raises(ConfigError, match="this workload's steps: one process, replicas"):
        plan(inputs)


def test_a_surely_missed_slo_stops_the_run_and_a_met_one_runs_to_the_end(
        round_profile: LatencyProfile) -> None:
    """At 25 req/s one instance falls behind by 0.5 s of work per second: the 61st request
    over 500 ms beyond ceil(599 x 0.1) + 1 = 61 (the 62nd) ends the run long before the
    600th: the p90 then surely falls among the late ones."""
    inputs = PlanInputs(prefill_only(25.0), Slo(ttft_ms=500, tpot_ms=100), round_profile,
                        shape=ONE_SLOT, costs=Costs(request_overhead_ms=0.0))
    one, run = simulate(Architecture("one process", policy="round_robin"), inputs,
                        stop_early=True)
    late = [t for t in run.turns if t.first_token_s is not None
            and t.first_token_s - t.arrival_s > 0.5]
    assert run.is_stopped_early and len(late) == 62
    assert len(run.turns) < 600
    two, run = simulate(Architecture("replicas", replicas=2, policy="round_robin"), inputs,
                        stop_early=True)
    assert not run.is_stopped_early and len(run.turns) == 600 and two.meets_slo
