"""The long fuzz run: many mutated bodies (tests/harness/mutations.py) against a simulated
instance and a gateway in front of it, real processes, judged by tests/harness/fuzz.py.

    .venv/bin/python bench/fuzz.py [--num N] [--seed S] [--keyed]

Prints and writes .bench/results/fuzz.json: per target, the outcomes (ok, refused, busy and the
failures: bad_body, server, reset, hang) and the first findings. Exits 1 on any finding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.fuzz import run_fuzz  # noqa: E402
from harness.mutations import Mutator  # noqa: E402
from sim_stack import CLIENT_KEY, MODEL, sim_stack  # noqa: E402

RESULTS = ROOT / ".bench" / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num", type=int, default=20_000, help="mutated bodies per target")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keyed", action="store_true", help="send them with a client key")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {CLIENT_KEY}"} if args.keyed else None
    results = {}
    with sim_stack(Path(tempfile.mkdtemp(prefix="strata-fuzz-")), keyed=args.keyed) as stack:
        for name, url in stack.urls.items():
            mutants = Mutator(args.seed, MODEL).mutants(args.num)
            report = asyncio.run(run_fuzz(url, mutants, concurrency=8, headers=headers))
            results[name] = report.to_json()
            print(name, json.dumps(results[name]["outcomes"]), f"{report.elapsed_s:.1f}s",
                  f"findings: {len(report.findings)}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fuzz.json").write_text(json.dumps({"seed": args.seed, **results}, indent=2))
    return 1 if any(r["num_findings"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
