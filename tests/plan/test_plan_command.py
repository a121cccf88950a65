"""`strata plan` as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ARGS = ["--num-requests", "20", "--prompt-tokens", "64", "--output-tokens", "8",
        "--steps", "one process,replicas", "--max-ranks", "4"]


def strata_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "strata.cli", "plan", *args],
                          capture_output=True, text=True, timeout=240)


def test_plan_prints_json_with_the_cheapest_configuration() -> None:
    done = strata_plan("--rate", "4", *ARGS, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["profile"]["model"] == "SmolLM2-135M-Instruct"
    assert doc["best"]["config"] == "1x"
    assert {row["step"] for row in doc["configs"]} == {"one process", "replicas"}


def test_plan_prints_a_table() -> None:
    done = strata_plan("--concurrency", "2", *ARGS)
    assert done.returncode == 0, done.stderr
    assert "cheapest that meets the SLO: 1x" in done.stdout


def test_plan_without_a_load_says_what_to_give() -> None:
    done = strata_plan(*ARGS)
    assert done.returncode == 1
    assert "give the load: --rate REQ_PER_S or --concurrency N" in done.stderr


def test_plan_with_a_bad_length_or_profile_fails_clearly(tmp_path: Path) -> None:
    done = strata_plan("--rate", "1", "--prompt-tokens", "lots")
    assert done.returncode == 1 and "a length is N or LOW:HIGH" in done.stderr
    done = strata_plan("--rate", "1", "--profile", str(tmp_path / "nope.json"))
    assert done.returncode == 1 and "no such profile file" in done.stderr


def test_plan_reads_a_bench_trace(tmp_path: Path) -> None:
    report = {"config": {"workload": "fixed", "num_requests": 12, "input_len": 64,
                         "output_len": 8, "prefix_len": 0, "num_sessions": 1, "num_turns": 1,
                         "concurrency": 2, "request_rate": None, "seed": 0},
              "ttft_ms": {"p50": 90.0}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    done = strata_plan("--trace", str(path), "--steps", "one process", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["workload"]["num_requests"] == 12 and doc["workload"]["concurrency"] == 2
    assert doc["measured"] == {"ttft_ms": {"p50": 90.0}}


def test_the_cli_default_session_write_is_the_planners() -> None:
    """`strata plan --session-write-ms` states its default as a literal (importing the planner
    would slow every command's start): it must be the planner's own SESSION_WRITE_MS."""
    import argparse

    from strata.commands import plan
    from strata.plan.costs import SESSION_WRITE_MS

    parser = argparse.ArgumentParser()
    plan.add_parser(parser.add_subparsers())
    assert parser.parse_args(["plan"]).session_write_ms == SESSION_WRITE_MS
