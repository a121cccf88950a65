"""Soak: mixed load through `strata up` for a long time; memory, open files and errors over time.

    .venv/bin/python bench/soak.py [--minutes 30] [--sample-s 10] [--no-real]

The cluster: `strata up --replicas 2 --simulate` (20 ms decode step) and one real instance of
the default model (SmolLM2-135M, `strata serve --registry` into the cluster's registry, one torch
thread) behind the same gateway, sessions in SQLite. The load (tests/harness/chaos_load.py): on
the simulated model 4 conversations (session turns, every other one streamed; a new session
every 8 turns) and 4 workers of streams and plain requests; on the real model 1 conversation
(a new session every 4 turns) and 1 worker. Every `--sample-s`, the resident memory (VmRSS) and
open file descriptors of every process are read from /proc. Reported: per process, the first
and last samples and the least-squares slope after a warm-up (the first 20% of the run), in MB
and descriptors per hour; errors per 5-minute window; turns lost (acknowledged, not stored).
Writes .bench/results/soak.json (with the load average) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.chaos_load import ChaosLoad, LoadResult, check_sessions
from harness.faults import (
    PROFILE,
    Place,
    pids,
    start_cluster,
    stop_cluster,
    wait_for_instances,
)
from harness.procs import Proc, spawn

from strata.cluster.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / ".bench" / "results"
SIM, REAL = PROFILE.model, "smollm2"
WINDOW_S = 300.0


def proc_sample(pid: int) -> tuple[float, int] | None:
    """(resident MB, open descriptors) of `pid`, or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        num_fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss_kb = next(int(line.split()[1]) for line in status.splitlines()
                  if line.startswith("VmRSS:"))
    return rss_kb / 1024, num_fds


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per hour."""
    if len(points) < 3:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    num = sum((t - mean_t) * (v - mean_v) for t, v in points)
    den = sum((t - mean_t) ** 2 for t, _ in points)
    return num / den * 3600 if den else 0.0


def start_real(root: Path, run_dir: Path) -> Proc:
    registry = f"sqlite:///{run_dir}/registry.db"
    return spawn("real-instance", [
        sys.executable, "-m", "strata.cli", "serve", "--served-model-name", REAL,
        "--registry", registry, "--instance-id", "real-0", "--port", str(free_port()),
        "--threads", "1", "--max-model-len", "2048", "--kv-cache-gb", "0.25",
        "--session-store", f"sqlite:///{root}/sessions.db", "--log-level", "warning"],
        root / "logs")


def analyse(samples: dict[str, list[tuple[float, float, int]]], duration_s: float,
            warmup_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, points in samples.items():
        steady = [p for p in points if p[0] >= warmup_s] or points
        last_half = [p for p in points if p[0] >= duration_s / 2] or points
        out[name] = {
            "rss_mb_first": round(points[0][1], 1), "rss_mb_last": round(points[-1][1], 1),
            "rss_mb_max": round(max(p[1] for p in points), 1),
            "rss_mb_per_hour": round(slope_per_hour([(t, r) for t, r, _ in steady]), 2),
            "fds_first": points[0][2], "fds_last": points[-1][2],
            "fds_max": max(p[2] for p in points),
            "fds_per_hour": round(slope_per_hour([(t, float(f)) for t, _, f in steady]), 2),
            "rss_mb_per_hour_last_half": round(slope_per_hour(
                [(t, r) for t, r, _ in last_half]), 2),
            "samples": [(round(t), round(r, 1), f) for t, r, f in points]}
    return out


def errors_by_window(results: Sequence[LoadResult], started: float) -> list[dict[str, int]]:
    windows: dict[int, dict[str, int]] = {}
    for result in results:
        for o in result.outcomes:
            w = windows.setdefault(int((o.ended_at - started) // WINDOW_S),
                                   {"sent": 0, "failed": 0})
            w["sent"] += 1
            w["failed"] += not o.is_ok
    return [{"minute": int(k * WINDOW_S // 60), **v} for k, v in sorted(windows.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--no-real", action="store_true", help="simulated instances only")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="soak-"))
    up_args = ["--replicas", "2", "--simulate", str(root / "profile.json"),
               "--served-model-name", SIM, "--session-store", f"sqlite:///{root}/sessions.db",
               "--log-level", "warning"]
    PROFILE.save(root / "profile.json")
    load_start = os.getloadavg()
    up = start_cluster(Place(root, dict(os.environ)), up_args)
    real = None if args.no_real else start_real(root, root / "run")
    loads: list[ChaosLoad] = []
    try:
        wait_for_instances(up.url, 2 if real is None else 3, timeout_s=300)
        loads.append(ChaosLoad(up.url, SIM, num_conversations=4, num_streams=4, max_tokens=32,
                               turns_per_session=8, prefix="soak-sim").start())
        if real is not None:
            loads.append(ChaosLoad(up.url, REAL, num_conversations=1, num_streams=1,
                                   max_tokens=16, turns_per_session=4, timeout_s=300,
                                   prefix="soak-real").start())
        samples = sample(up, real, root, args.minutes * 60, args.sample_s)
        results = [load.stop(timeout_s=300) for load in loads]
        report(args, up, results, samples, load_start, up_args)
    finally:
        for load in loads:
            load.stop(timeout_s=10)
        if real is not None:
            real.stop(sig=signal.SIGTERM)
        stop_cluster(up)
        shutil.rmtree(root, ignore_errors=True)


def sample(up: Proc, real: Proc | None, root: Path, duration_s: float,
           every_s: float) -> dict[str, list[tuple[float, float, int]]]:
    started = time.monotonic()
    samples: dict[str, list[tuple[float, float, int]]] = {}
    while (now := time.monotonic() - started) < duration_s:
        named = {"strata-up": up.pid, **pids(root)}
        if real is not None:
            named["real-0"] = real.pid
        for name, pid in named.items():
            got = proc_sample(pid)
            if got is not None:
                samples.setdefault(name, []).append((now, got[0], got[1]))
        time.sleep(every_s)
    return samples


def report(args: argparse.Namespace, up: Proc, results: list[LoadResult],
           samples: dict[str, list[tuple[float, float, int]]],
           load_start: tuple[float, float, float], up_args: list[str]) -> None:
    started = min(o.started_at for r in results for o in r.outcomes)
    lost = sum(check_sessions(up.url, r).num_lost for r in results)
    out = {"minutes": args.minutes, "sample_s": args.sample_s, "with_real": not args.no_real,
           "command": "strata up " + " ".join(up_args),
           "sent": sum(r.num_sent for r in results),
           "failed": sum(len(r.failures) for r in results),
           "turns_acked": sum(r.num_turns_acked for r in results), "turns_lost": lost,
           "errors": sorted({o.error[:160] for r in results for o in r.failures})[:5],
           "windows": errors_by_window(results, started),
           "processes": analyse(samples, args.minutes * 60, args.minutes * 60 * 0.2),
           "load_average_start": load_start, "load_average_end": os.getloadavg()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(out, indent=2))
    print("| process | RSS MB first -> last (max) | RSS MB/hour after warm-up (last half) | "
          "fds first -> last | fds/hour |\n|---|---|---|---|---|")
    for name, p in out["processes"].items():
        print(f"| {name} | {p['rss_mb_first']} -> {p['rss_mb_last']} ({p['rss_mb_max']}) | "
              f"{p['rss_mb_per_hour']} ({p['rss_mb_per_hour_last_half']}) | "
              f"{p['fds_first']} -> {p['fds_last']} | {p['fds_per_hour']} |")
    print("\n| minutes | sent | failed |\n|---|---|---|")
    for w in out["windows"]:
        print(f"| {w['minute']}-{w['minute'] + int(WINDOW_S // 60)} | {w['sent']} | "
              f"{w['failed']} |")
    print(f"\nsent {out['sent']}, failed {out['failed']}, turns acked {out['turns_acked']}, "
          f"lost {lost}; load average {load_start} -> {out['load_average_end']}")


if __name__ == "__main__":
    main()
