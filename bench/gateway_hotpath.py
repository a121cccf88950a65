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

Variants of the round_robin gateway (issue 29), each a path of its own:
`strata-trace0` (tracing off: the baseline of the others, the same command as
strata-round_robin), `strata-trace1pct` and `strata-trace100` (`--otlp-endpoint` to a stand-in
collector, bench/otlp_sink.py, with `--trace-sample-ratio` 0.01 and 1.0; only the gateway traces,
the instances do not) and `strata-budgets` (`--api-key-file` with one key whose rpm/tpm are far
above what the run sends, so the key check, the meter and the budget check run on every request
and none is refused; the client sends the key). Every path's req/s is also given as a ratio to
strata-trace0's in the same round when that path runs; the collector's counts of exports and
spans per gateway are in the JSON and printed at the end.
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
import httpx
from gateway_overhead import SIM_MODEL, SIM_PROFILE, drive, smoke, start_instance, start_path
from harness.procs import spawn as spawn_in
from procs import Proc, spawn, stop_all, wait_http

from strata.bench import report as bench_report
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
BASELINE = "strata-trace0"
BENCH_KEY = "sk-bench-hotpath"
# far above the run's rate (at most a few thousand requests and ~100k tokens a minute)
BUDGET_LINE = f"{BENCH_KEY} rpm=100000000 tpm=1000000000"
TRACE_RATIOS = {"strata-trace1pct": "0.01", "strata-trace100": "1.0"}
VARIANTS = {BASELINE, "strata-budgets", *TRACE_RATIOS}


def start_sink(log_dir: Path) -> Proc:
    """The stand-in OTLP/HTTP collector (bench/otlp_sink.py)."""
    port = free_port()
    proc = spawn("otlp-sink", [PY, str(ROOT / "bench" / "otlp_sink.py"), "--port", str(port)],
                 log_dir, f"http://127.0.0.1:{port}")
    wait_http(proc, "/counts", 20)
    return proc


def start_variant(path: str, urls: list[str], log_dir: Path, sink: Proc | None) -> Proc:
    """A round_robin gateway with the flags of the variant `path` (see the docstring)."""
    extra: tuple[str, ...] = ()
    if path in TRACE_RATIOS:
        assert sink is not None
        extra = ("--otlp-endpoint", f"{sink.url}/{path}",
                 "--trace-sample-ratio", TRACE_RATIOS[path])
    elif path == "strata-budgets":
        key_file = BENCH / "tmp" / "hotpath-keys.txt"
        key_file.write_text(BUDGET_LINE + "\n")
        extra = ("--api-key-file", str(key_file))
    proc = gateway_overhead.start_gateway(path, urls, "round_robin", log_dir, extra)
    wait_http(proc, "/ready", 30)
    return proc


def sink_counts(sink: Proc | None) -> dict[str, Any]:
    if sink is None:
        return {}
    try:
        return httpx.get(sink.url + "/counts", timeout=5).json()
    except httpx.HTTPError as exc:
        return {"error": str(exc)}


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
            proc: Proc | None, headers: dict[str, str] | None = None) -> dict[str, Any]:
    cpu_before = cpu_s(proc)
    if concurrency == 1:
        s = drive(urls, SIM_MODEL, args.c1_requests, 1, max_tokens=8, timeout_s=300,
                  headers=headers)
    else:
        s = drive(urls, SIM_MODEL, args.cn_requests, concurrency, max_tokens=32, timeout_s=300,
                  headers=headers)
    num = s["num_completed"] or 1
    return {"router_cpu_us_per_req": 1e6 * (cpu_s(proc) - cpu_before) / num,
            "req_s": s["requests_per_s"], "num_requests": s["num_requests"],
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
                                   "req_s", "router_cpu_us_per_req")}
            if BASELINE in runs:
                row[c]["req_s_vs_base"] = spread([
                    r["req_s"] / x["req_s"] if x["req_s"] else float("nan")
                    for r, x in zip(rounds, runs[BASELINE][c], strict=True)])
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
              f"{'ITL p99':>10}{'added ITL p99':>28}{'tok/s':>9}{'req/s':>8}{'vs base':>9}"
              f"{'cpu us/req':>11}{'fail':>6}")
        for path, row in summary.items():
            r = row[c]
            print(f"{path:<22}{fmt(r['added_ttft_p10']):>28}{r['ttft_p50']['median']:>10.2f}{fmt(r['added_ttft_p50']):>28}"
                  f"{fmt(r['added_ttft_p99']):>30}{r['itl_p99']['median']:>10.2f}"
                  f"{fmt(r['added_itl_p99']):>28}{r['tok_s']['median']:>9.0f}"
                  f"{r['req_s']['median']:>8.1f}"
                  f"{r['req_s_vs_base']['median'] if 'req_s_vs_base' in r else float('nan'):>9.3f}"
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
    sink: Proc | None = None
    sent: dict[str, int] = {}  # requests sent to each path, warm-ups and smoke included
    try:
        for proc in instances:
            wait_http(proc, "/v1/models", 60)
        urls = [p.url for p in instances]
        if any(p in TRACE_RATIOS for p in args.paths):
            sink = start_sink(log_dir)
        for path in args.paths:
            if path in VARIANTS:
                started[path] = start_variant(path, urls, log_dir, sink)
            elif path != "direct":
                started[path] = start_path(path, urls, log_dir)
        for name, tree in trees.items():
            started[f"strata-{name}"] = start_ref_gateway(f"strata-{name}", tree, urls, log_dir)
        targets: dict[str, list[str]] = {"direct": urls,
                                         **{k: [p.url] for k, p in started.items()}}
        headers = {"strata-budgets": {"Authorization": f"Bearer {BENCH_KEY}"}}
        for path, turls in targets.items():
            smoke(turls[0], SIM_MODEL, headers.get(path))
            sent[path] = 1
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {
            p: {c: [] for c in args.concurrency} for p in targets}
        order = list(targets)
        for rnd in range(args.rounds):
            rotated = order[rnd % len(order):] + order[:rnd % len(order)]
            load_start = os.getloadavg()
            for path in rotated:
                drive(targets[path], SIM_MODEL, 16, 16, 8,  # warm-up: connections
                      headers=headers.get(path))
                sent[path] += 16
                for c in args.concurrency:
                    m = measure(targets[path], c, args, started.get(path), headers.get(path))
                    runs[path][c].append(m)
                    sent[path] += m["num_requests"]
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
        stop_all([*started.values(), *instances])  # a gateway flushes its spans as it stops
        report["collector_counts"] = sink_counts(sink)
        report["requests_sent"] = sent
        if sink is not None:
            sink.stop()
            print(f"\ncollector (spans after the gateways stopped): {report['collector_counts']}"
                  f"; requests sent per path: {sent}")
    Path(args.out).write_text(json.dumps(json_safe(report), indent=2))
    print(f"\nwrote {args.out}; load {report['load_average_start']} -> "
          f"{report.get('load_average_end')}")


if __name__ == "__main__":
    main()
