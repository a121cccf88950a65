"""Workloads, SLOs and traces: what a plan is asked about, and bad input refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strata.errors import ConfigError
from strata.plan import LengthDist, Slo, Workload, workload_from_bench_report
from strata.plan.workload import build_jobs


def test_lengths_parse_fixed_and_ranges_and_refuse_the_rest() -> None:
    assert LengthDist.parse("128") == LengthDist(128, 128)
    assert LengthDist.parse("64:256") == LengthDist(64, 256)
    with pytest.raises(ConfigError, match="a length is N or LOW:HIGH"):
        LengthDist.parse("many")
    with pytest.raises(ConfigError, match="1 <= low <= high"):
        LengthDist.parse("256:64")


def test_a_workload_needs_exactly_one_kind_of_load() -> None:
    with pytest.raises(ConfigError, match="exactly one of a request rate"):
        Workload()
    with pytest.raises(ConfigError, match="exactly one of a request rate"):
        Workload(rate_per_s=1.0, concurrency=2)
    with pytest.raises(ConfigError, match="request rate must be positive"):
        Workload(rate_per_s=0.0)


def test_slo_bounds_and_percentiles_are_checked() -> None:
    with pytest.raises(ConfigError, match="must be positive"):
        Slo(0, 100)
    with pytest.raises(ConfigError, match="percentile is in"):
        Slo(100, 100, ttft_percentile=120)


def test_sessions_share_their_prefix_and_count_every_turn() -> None:
    workload = Workload(num_requests=10, concurrency=2, num_turns=4, prefix_tokens=32,
                        prompt=LengthDist(8, 8))
    jobs = build_jobs(workload)
    assert [len(j.turns) for j in jobs] == [4, 4, 2]
    assert all(j.prefix_token_ids == jobs[0].prefix_token_ids for j in jobs)
    assert jobs[0].session_id == "s0"
    assert build_jobs(workload)[1].turns[0] == jobs[1].turns[0]  # seeded


def test_a_bench_report_gives_its_workload_and_its_measurements(tmp_path: Path) -> None:
    report = {"config": {"workload": "shared-prefix", "num_requests": 40, "input_len": 32,
                         "output_len": 16, "prefix_len": 500, "num_sessions": 8,
                         "num_turns": 4, "concurrency": 4, "request_rate": None, "seed": 3},
              "ttft_ms": {"p50": 80.0}, "tpot_ms": {"p50": 20.0}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    workload, measured = workload_from_bench_report(path)
    assert workload == Workload(num_requests=40, concurrency=4, prompt=LengthDist(32, 32),
                                output=LengthDist(16, 16), prefix_tokens=500, seed=3)
    assert measured == {"ttft_ms": {"p50": 80.0}, "tpot_ms": {"p50": 20.0}}


def test_a_file_that_is_not_a_bench_report_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"format": 1}')
    with pytest.raises(ConfigError, match="not a `strata bench --out` report"):
        workload_from_bench_report(path)
    with pytest.raises(ConfigError, match="not a `strata bench --out` report"):
        workload_from_bench_report(tmp_path / "missing.json")
