"""Splits the test files into the parts `make test` runs side by side, balanced by how long each
file took (tests/durations.json, refreshed by `make durations`), and records new durations.

    python tests/split.py part I N      the files of part I of N (0-based), one a line
    python tests/split.py record A B..  merge the `--record-durations` files A, B.. into
                                        tests/durations.json (files no longer there dropped)
    python tests/split.py cpu WALL A B..  the `--record-cpu` files A, B.. of a run of WALL
                                        seconds: CPU used against the cores' time, top files

Longest first, each file to the part with the least time so far (LPT: within 4/3 of the best
split). A file not yet measured counts as the median of the measured ones.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DURATIONS = TESTS / "durations.json"


def test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in TESTS.rglob("test_*.py"))


def load() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def split(files: list[str], seconds: dict[str, float], num_parts: int) -> list[list[str]]:
    known = [seconds[f] for f in files if f in seconds]
    default = statistics.median(known) if known else 1.0
    cost = {f: seconds.get(f, default) for f in files}
    parts: list[list[str]] = [[] for _ in range(num_parts)]
    totals = [0.0] * num_parts
    for f in sorted(files, key=lambda f: (-cost[f], f)):
        i = totals.index(min(totals))
        parts[i].append(f)
        totals[i] += cost[f]
    return [sorted(p) for p in parts]


def record(recorded: list[Path]) -> dict[str, float]:
    merged: dict[str, float] = {}
    for path in recorded:
        merged.update(json.loads(path.read_text()))
    present = set(test_files())
    kept = {f: s for f, s in sorted(merged.items()) if f in present}
    DURATIONS.write_text(json.dumps(kept, indent=1) + "\n")
    return kept


def cpu_summary(wall_s: float, recorded: list[Path], top: int = 8) -> str:
    """How busy the cores were: with the parts' CPU near every core's whole time, the suite is
    bound by CPU (a third part would not help); well under it, by waits."""
    merged: dict[str, float] = {}
    for path in recorded:
        merged.update(json.loads(path.read_text()))
    used, cores = sum(merged.values()), os.cpu_count() or 1
    lines = [f"+ CPU: {used:.0f} s used by the tests and their processes over {wall_s:.0f} s "
             f"wall on {cores} cores ({used / max(wall_s * cores, 1e-9):.0%} of their time)"]
    ranked = sorted(merged.items(), key=lambda kv: -kv[1])[:top]
    lines += [f"    {s:7.1f} s  {f}" for f, s in ranked]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv[:1] == ["part"] and len(argv) == 3:
        index, num = int(argv[1]), int(argv[2])
        print("\n".join(split(test_files(), load(), num)[index]))
    elif argv[:1] == ["record"] and len(argv) > 1:
        kept = record([Path(a) for a in argv[1:]])
        print(f"{DURATIONS.relative_to(ROOT)}: {len(kept)} files, {sum(kept.values()):.0f} s")
    elif argv[:1] == ["cpu"] and len(argv) > 2:
        print(cpu_summary(float(argv[1]), [Path(a) for a in argv[2:] if Path(a).exists()]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
