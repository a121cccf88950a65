"""`strata doctor`: what is installed, and which optional parts are usable (and why not).

    strata doctor           plain text
    strata doctor --json    the same as one JSON object

It always exits 0: it reports, it does not judge. The packages are grouped as pyproject.toml
declares them (base, `ray`, `dev`), read from the installed metadata; the parts are Ray, the Redis
client, a redis-server binary, the C kernels (built here, as the model would build them), CUDA,
the default model in the cache and chromium for the dashboard's browser tests
(doctor_checks.py). Last, the matmul kernels this CPU runs (AMX tiles, AVX512-BF16 vector,
portable) and whether a request's tokens can depend on its batch by default (`matmul`).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any

from strata.commands.doctor_checks import (
    Part,
    Probe,
    matmul_report,
    packages_by_extra,
    run_checks,
    system_probe,
)
from strata.commands.env import CliEnv

EXTRA_HINTS = {
    "ray": "pip install 'strata[ray]'",
    "dev": "`make test`, or pip install -e '.[dev]'",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="what is installed and which optional parts are usable")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def report(probe: Probe) -> dict[str, Any]:
    """Everything doctor found, JSON-ready."""
    from strata import __version__

    return {
        "strata": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "executable": sys.executable,
        "cache_dir": str(probe.cache_dir),
        "packages": packages_by_extra(probe.requires(), probe.version),
        "parts": [{"name": p.name, "title": p.title, "usable": p.is_usable, "detail": p.detail}
                  for p in run_checks(probe)],
        "matmul": matmul_report(probe.matmul()),
    }


def format_text(found: dict[str, Any]) -> str:
    lines = [f"strata {found['strata']} (Python {found['python']}, {found['platform']})",
             f"python: {found['executable']}", f"cache: {found['cache_dir']}", "",
             "installed:"]
    for group, packages in found["packages"].items():
        lines.append(f"  {group:<5} {_group_line(group, packages)}")
    lines += ["", "optional parts:"]
    parts = [Part(p["name"], p["title"], p["usable"], p["detail"]) for p in found["parts"]]
    width = max((len(p.title) for p in parts), default=0)
    for part in parts:
        mark = "ok" if part.is_usable else "no"
        lines.append(f"  [{mark}] {part.title:<{width}}  {part.detail}")
    matmul = found["matmul"]
    lines += ["", f"matmul kernels: {', '.join(matmul['kernels']) or 'none'}",
              f"  {matmul['detail']}"]
    return "\n".join(lines)


def _group_line(group: str, packages: dict[str, str | None]) -> str:
    missing = [name for name, version in packages.items() if version is None]
    installed = len(packages) - len(missing)
    if not missing:
        if len(packages) <= 3:
            return "installed: " + ", ".join(f"{n} {v}" for n, v in packages.items())
        return f"all {installed} installed"
    if not installed:
        what = f"not installed ({', '.join(missing)})"
    else:
        what = f"{installed} of {len(packages)} installed; missing {', '.join(missing)}"
    hint = EXTRA_HINTS.get(group)
    return f"{what}: {hint}" if hint else what


def run(args: argparse.Namespace, env: CliEnv) -> int:
    found = report(system_probe(env.cache_dir))
    print(json.dumps(found, indent=2) if args.json else format_text(found))
    return 0


__all__ = ["add_parser", "format_text", "report", "run"]
