"""Gateway hot path (issue 18 item 4): added TTFT and ITL at 1 and 64 concurrent streams, the
Strata gateway against the Rust routers, interleaved rounds.

    .venv/bin/python bench/gateway_hotpath.py [--rounds 5] [--concurrency 1 64]
        [--paths direct strata-round_robin sglang-router vllm-router]
        [--ref NAME=COMMIT ...]

Two simulated instances (`strata serve --simulate`, the fitted SmolLM2 CPU profile) and every
path started once; then each round runs every path (in a rotated order, so no path always
follows the same one) at every concurrency: c=1 sends `--c1-requests` streams of 8 tokens one
after the other, c=N sends `--cn-requests` streams of 32 tokens with N in flight. "Added" is a
path's TTFT p50/p99 minus direct's in the same round; medians and [min..max] over the rounds.

`--ref NAME=COMMIT` adds a path `strata-NAME`: the gateway of `COMMIT` (extracted with
`git archive` under .bench/ref/), run with this checkout's virtualenv, so a before/after runs
in one interleaved benchmark. Writes .bench/results/gateway_hotpath.json; prints the load
average at the start and the end of every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gateway_overhead
from gateway_overhead import SIM_MODEL, SIM_PROFILE, drive, smoke, start_instance, start_path
from procs import Proc, stop_all, wait_http

from strata.bench import report as bench_report
from harness.procs import spawn as spawn_in
from strata.bench.report import RequestResult, json_safe, percentile
from strata.cluster.ports import free_port

_last_ttfts_s: list[float] = []  # the TTFTs of the latest `drive`, for percentiles it omits


def _summarize_keeping_ttfts(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    _last_ttfts_s[:] = [r.ttft_s for r in results if r.is_ok and r.ttft_s is not None]
    return bench_report.summarize(results, duration_s)


gateway_overhead.summarize = _summarize_keeping_ttfts

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")
BENCH = ROOT / ".bench"
REFS = BENCH / "ref"
RESULTS = BENCH / "results"


def extract(commit: str) -> Path:
    """`commit`'s tree under .bench/ref/COMMIT (once)."""
    sha = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    target = REFS / sha[:12]
    if not (target / "strata").exists():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def start_ref_gateway(name: str, tree: Path, urls: list[str], log_dir: Path) -> Proc:
    """The gateway of an extracted tree: run from that tree so `strata` is imported from it."""
    port = free_port()
    argv = [PY, "-m", "strata.cli", "gateway", "--port", str(port), "--policy", "round_robin",
            "--log-level", "warning", "--instances", *urls]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = spawn_in(name, argv, log_dir, url=f"http://127.0.0.1:{port}", env=env, cwd=tree)
    wait_http(proc, "/ready", 30)
    return proc


def cpu_s(proc: Proc | None) -> float:
    """User + system CPU seconds of the process (all its threads) so far."""
    if proc is None:
        return 0.0
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(urls: list[str], concurrency: int, args: argparse.Namespace,
            proc: Proc | None) -> dict[str, Any]:
    cpu_before = cpu_s(proc)
    if concurrency == 1:
        s = drive(urls, SIM_MODEL, args.c1_requests, 1, max_tokens=8, timeout_s=300)
    else:
        s = drive(urls, SIM_MODEL, args.cn_requests, concurrency, max_tokens=32, timeout_s=300)
    num = s["num_completed"] or 1
    return {"router_cpu_us_per_req": 1e6 * (cpu_s(proc) - cpu_before) / num,
            "ttft_p10": 1000 * percentile(_last_ttfts_s, 10),
            "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "itl_p50": s["itl_ms"]["p50"], "itl_p99": s["itl_ms"]["p99"],
            "tok_s": s["output_tokens_per_s"], "failures": s["num_failures"]}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    direct = runs["direct"]
    for path, by_c in runs.items():
        row: dict[str, Any] = {}
        for c, rounds in by_c.items():
            d = direct[c]
            row[c] = {key: spread([r[key] for r in rounds])
                      for key in ("ttft_p10", "ttft_p50", "ttft_p99", "itl_p99", "tok_s",
                                   "router_cpu_us_per_req")}
            row[c]["added_ttft_p50"] = spread([r["ttft_p50"] - x["ttft_p50"]
                                               for r, x in zip(rounds, d, strict=True)])
            row[c]["added_ttft_p10"] = spread([r["ttft_p10"] - x["ttft_p10"]
                                               for r, x in zip(rounds, d, strict=True)])
            row[c]["added_ttft_p99"] = spread([r["ttft_p99"] - x["ttft_p99"]
                                               for r, x in zip(rounds, d, strict=True)])
            row[c]["added_itl_p99"] = spread([r["itl_p99"] - x["itl_p99"]
                                              for r, x in zip(rounds, d, strict=True)])
            row[c]["failures"] = sum(r["failures"] for r in rounds)
        out[path] = row
    return out


def fmt(s: dict[str, float], signed: bool = True) -> str:
    f = "{:+.2f}" if signed else "{:.2f}"
    return f"{f.format(s['median'])} [{f.format(s['min'])}..{f.format(s['max'])}]"


def print_table(summary: dict[str, Any], concurrencies: list[int]) -> None:
    for c in concurrencies:
        print(f"\n== c={c} ==  medians over rounds [min..max]")
        print(f"{'path':<22}{'added TTFT p10':>28}{'TTFT p50':>10}{'added TTFT p50':>28}"
              f"{'added TTFT p99':>30}"
              f"{'ITL p99':>10}{'added ITL p99':>28}{'tok/s':>9}{'cpu us/req':>11}{'fail':>6}")
        for path, row in summary.items():
            r = row[c]
            print(f"{path:<22}{fmt(r['added_ttft_p10']):>28}{r['ttft_p50']['median']:>10.2f}{fmt(r['added_ttft_p50']):>28}"
                  f"{fmt(r['added_ttft_p99']):>30}{r['itl_p99']['median']:>10.2f}"
                  f"{fmt(r['added_itl_p99']):>28}{r['tok_s']['median']:>9.0f}"
                  f"{r['router_cpu_us_per_req']['median']:>11.0f}{r['failures']:>6}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--paths", nargs="+",
                    default=["direct", "strata-round_robin", "sglang-router", "vllm-router"])
    ap.add_argument("--ref", action="append", default=[], metavar="NAME=COMMIT")
    ap.add_argument("--c1-requests", type=int, default=100)
    ap.add_argument("--cn-requests", type=int, default=640)
    ap.add_argument("--out", default=str(RESULTS / "gateway_hotpath.json"))
    args = ap.parse_args()
    (BENCH / "tmp").mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_dir = BENCH / "logs" / "gateway_hotpath"
    refs = dict(item.split("=", 1) for item in args.ref)
    trees = {name: extract(commit) for name, commit in refs.items()}
    report: dict[str, Any] = {"load_average_start": os.getloadavg(), "argv": sys.argv,
                              "refs": refs, "rounds": []}
    instances = [start_instance(f"sim-{i}", log_dir, simulate=SIM_PROFILE,
                                model_name=SIM_MODEL) for i in range(2)]
    started: dict[str, Proc] = {}
    try:
        for proc in instances:
            wait_http(proc, "/v1/models", 60)
        urls = [p.url for p in instances]
        for path in args.paths:
            if path != "direct":
                started[path] = start_path(path, urls, log_dir)
        for name, tree in trees.items():
            started[f"strata-{name}"] = start_ref_gateway(f"strata-{name}", tree, urls, log_dir)
        targets: dict[str, list[str]] = {"direct": urls,
                                         **{k: [p.url] for k, p in started.items()}}
        for turls in targets.values():
            smoke(turls[0], SIM_MODEL)
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {
            p: {c: [] for c in args.concurrency} for p in targets}
        order = list(targets)
        for rnd in range(args.rounds):
            rotated = order[rnd % len(order):] + order[:rnd % len(order)]
            load_start = os.getloadavg()
            for path in rotated:
                drive(targets[path], SIM_MODEL, 16, 16, 8)  # warm-up: connections
                for c in args.concurrency:
                    m = measure(targets[path], c, args, started.get(path))
                    runs[path][c].append(m)
                    print(f"[r{rnd}] {path:<22} c={c:<3} ttft p50 {m['ttft_p50']:7.2f} "
                          f"p99 {m['ttft_p99']:7.2f}  itl p99 {m['itl_p99']:7.2f}  "
                          f"{m['tok_s']:7.0f} tok/s  cpu {m['router_cpu_us_per_req']:6.0f} us/req  "
                          f"fail {m['failures']}", flush=True)
            report["rounds"].append({"order": rotated, "load_start": load_start,
                                     "load_end": os.getloadavg()})
            print(f"[r{rnd}] load {load_start[0]:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
            time.sleep(1.0)
        summary = summarize(runs)
        report.update(runs=runs, summary=summary, load_average_end=os.getloadavg())
        print_table(summary, args.concurrency)
    finally:
        stop_all([*started.values(), *instances])
    Path(args.out).write_text(json.dumps(json_safe(report), indent=2))
    print(f"\nwrote {args.out}; load {report['load_average_start']} -> "
          f"{report.get('load_average_end')}")


if __name__ == "__main__":
    main()
