"""P/D failures: `--trials` kills per kill point, failed requests and the time until the prefill
instance's blocks are free.

A real `strata gateway` (round robin, every prompt disaggregated) over `strata serve --simulate`
processes registered in a SQLite registry: one prefill and two decode instances; the instance of
the role the kill point belongs to runs with `--fault-config {"kill_at": POINT}` and SIGKILLs
itself there. A trial sends requests (not streamed: nothing has reached the client when a decode
instance dies, whatever the point) until the doomed instance died, checks every answer against
the same prompt answered by a healthy decode instance directly, measures how long after the
death the prefill instance still held blocks, restarts the doomed instance (same id and port)
and waits until the gateway routes to it again.

    .venv/bin/python bench/pd_failures.py [--trials 100] [--points decode_before_pull ...]

Writes .bench/results/pd_failures.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from procs import Proc, spawn, stop_all, wait_http

from strata.cluster.ports import free_port
from strata.server.pd.faults import KILL_POINTS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / ".bench" / "results" / "pd_failures.json"
PROFILE = "smollm2-cpu"


class Fleet:
    def __init__(self, point: str, work: Path) -> None:
        self.work = work
        self.registry = f"sqlite:///{work / 'registry.db'}"
        self.doomed_role = "prefill" if point.startswith("prefill") else "decode"
        (work / "faults.json").write_text(json.dumps({"kill_at": point}))
        self.ports = {name: free_port() for name in ("p", "d0", "d1", "gateway")}
        self.procs: dict[str, Proc] = {}
        self.doomed = "p" if self.doomed_role == "prefill" else "d0"

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start_instance(self, name: str) -> None:
        role = "prefill" if name == "p" else "decode"
        argv = [sys.executable, "-m", "strata.cli", "serve", "--simulate", PROFILE,
                "--port", str(self.ports[name]), "--registry", self.registry, "--instance-id",
                name, "--role", role, "--pd-lease-s", "10", "--log-level", "warning"]
        if name == self.doomed:
            argv += ["--fault-config", str(self.work / "faults.json")]
        self.procs[name] = proc = spawn(name, argv, self.work, self.url(name))
        wait_http(proc, "/ready", 120)

    def start(self) -> None:
        for name in ("p", "d0", "d1"):
            self.start_instance(name)
        argv = [sys.executable, "-m", "strata.cli", "gateway", "--port",
                str(self.ports["gateway"]), "--registry", self.registry, "--policy",
                "round_robin", "--pd-min-uncached-tokens", "0", "--log-level", "warning"]
        self.procs["gateway"] = gateway = spawn("gateway", argv, self.work, self.url("gateway"))
        gateway.wait_until(lambda: self.routable() >= {"p", "d0", "d1"}, 120, "all routable")

    def routable(self) -> set[str]:
        try:
            views = httpx.get(f"{self.url('gateway')}/admin/instances", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return set()
        return {v["instance_id"] for v in views["instances"] if v["routable"]}

    def held_blocks(self) -> float:
        text = httpx.get(f"{self.url('p')}/metrics", timeout=2).text
        match = re.search(r"^strata:pd_blocks_held (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def stop(self) -> None:
        stop_all(list(self.procs.values()))


def trial(fleet: Fleet, client: httpx.Client, n: int) -> dict[str, Any]:
    doomed = fleet.procs[fleet.doomed]
    failed, sent = 0, 0
    while doomed.is_running and sent < 6:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": f"trial {n} request {sent} " * 40,
                "max_tokens": 8, "temperature": 0}
        answer = client.post(f"{fleet.url('gateway')}/v1/completions", json=body)
        expected = client.post(f"{fleet.url('d1')}/v1/completions", json=body)
        sent += 1
        if answer.status_code != 200 or \
                answer.json()["choices"] != expected.json()["choices"]:
            failed += 1
    died_at = time.monotonic()
    if doomed.is_running:
        return {"sent": sent, "failed": failed, "killed": False, "free_s": None}
    free_s = None
    if fleet.doomed_role == "decode":
        while fleet.held_blocks() > 0 and time.monotonic() - died_at < 30:
            time.sleep(0.02)
        free_s = time.monotonic() - died_at
    fleet.start_instance(fleet.doomed)
    deadline = time.monotonic() + 60
    while fleet.doomed not in fleet.routable() and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"sent": sent, "failed": failed, "killed": True, "free_s": free_s}


def run_point(point: str, trials: int) -> dict[str, Any]:
    fleet = Fleet(point, Path(tempfile.mkdtemp(prefix=f"pd-fail-{point}-")))
    results = []
    try:
        fleet.start()
        with httpx.Client(timeout=60) as client:
            for n in range(trials):
                results.append(trial(fleet, client, n))
    finally:
        fleet.stop()
    frees = [r["free_s"] for r in results if r["free_s"] is not None]
    return {"point": point, "trials": len(results),
            "kills": sum(r["killed"] for r in results),
            "requests": sum(r["sent"] for r in results),
            "failed": sum(r["failed"] for r in results),
            "blocks_free_p50_s": round(statistics.median(frees), 3) if frees else None,
            "blocks_free_max_s": round(max(frees), 3) if frees else None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--points", nargs="+", default=list(KILL_POINTS), choices=KILL_POINTS)
    args = p.parse_args()
    rows = []
    for point in args.points:
        row = run_point(point, args.trials)
        row["load_average"] = [round(x, 2) for x in os.getloadavg()]
        rows.append(row)
        print(json.dumps(row), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"trials": args.trials, "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
