"""The plan's JSON (`strata plan --json`) and its table."""

from __future__ import annotations

import json

from strata.plan import LengthDist, PlanInputs, Slo, Workload, plan
from strata.plan.report import format_plan, plan_json
from strata.sim.profile import LatencyProfile

ROW_KEYS = {"config", "step", "policy", "replicas", "prefill_instances", "tp", "sessions",
            "kv_offload", "autoscaled", "instances", "ranks", "ttft_ms", "tpot_ms", "turn_ms",
            "output_tokens_per_s", "requests_per_s", "utilization", "prefix_hit_rate",
            "num_preemptions", "num_requests", "meets_slo", "bottleneck", "stopped_early",
            "simulated_in_s"}


def small_plan(profile: LatencyProfile, ttft_ms: float = 500) -> dict:
    workload = Workload(num_requests=20, rate_per_s=5.0, prompt=LengthDist(64, 128),
                        output=LengthDist(4, 4))
    inputs = PlanInputs(workload, Slo(ttft_ms, 100), profile, max_ranks=4,
                        steps=("one process", "replicas"))
    return plan_json(plan(inputs))


def test_the_json_has_every_config_the_best_and_what_rules_out_the_cheaper(
        round_profile: LatencyProfile) -> None:
    doc = json.loads(json.dumps(small_plan(round_profile), allow_nan=False))
    assert doc["format"] == 1 and doc["simulated"] is True
    assert doc["slo"] == {"ttft_ms": 500, "ttft_percentile": 90.0, "tpot_ms": 100,
                          "tpot_percentile": 90.0}
    assert doc["workload"]["prompt_tokens"] == [64, 128]
    assert doc["configs"] and all(set(row) == ROW_KEYS for row in doc["configs"])
    assert set(doc["configs"][0]["ttft_ms"]) == {"p50", "p90", "p99"}
    assert doc["best"]["config"] == "1x" and doc["best"]["meets_slo"] is True
    assert doc["ruled_out"] == []
    assert doc["num_simulations"] == len(doc["configs"])


def test_no_config_meeting_the_slo_is_said_and_every_one_is_ruled_out(
        round_profile: LatencyProfile) -> None:
    doc = small_plan(round_profile, ttft_ms=1)
    assert doc["best"] is None
    assert len(doc["ruled_out"]) == len(doc["configs"])
    assert all(row["bottleneck"] for row in doc["ruled_out"])


def test_the_table_marks_the_cheapest_and_says_it_is_simulated(
        round_profile: LatencyProfile) -> None:
    workload = Workload(num_requests=10, concurrency=2)
    text = format_plan(plan(PlanInputs(workload, Slo(500, 100), round_profile,
                                       steps=("one process",))))
    assert "SIMULATED" in text.splitlines()[0]
    assert "*1x " in text
    assert "cheapest that meets the SLO: 1x (1.0 ranks)" in text
