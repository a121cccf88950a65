"""Gateway overhead: the same two instances reached directly and through five proxies.

    .venv/bin/python bench/gateway_overhead.py [--quick] [--skip-real]

Paths: direct (client-side round robin over the two instance URLs), the Strata gateway
(round_robin and power_of_two), nginx (least_conn, proxy_buffering off), sglang-router and
vllm-router (round_robin; each in its own venv under .bench/peers/). Phase 1 uses simulated
instances (`strata serve --simulate`, the fitted SmolLM2 CPU profile), phase 2 real default-model
instances. Every path gets the same streamed-completion workload; paths are interleaved
(A B C ... A B C ...) and repeated. A peer that cannot be installed or started is recorded with
its error text. Writes .bench/results/gateway_overhead.json.

Process helpers live in bench/procs.py; `start_instance`, `start_gateway` and the paths here are
shared by bench/gateway_scaling.py, bench/failover.py and bench/release_switch.py.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from procs import Proc, spawn, stop_all, wait_http

from strata.bench.loadgen import Job, run_closed_loop, stream_request
from strata.bench.report import RequestResult, json_safe, summarize
from strata.cluster.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")
BENCH = ROOT / ".bench"
RESULTS = BENCH / "results"
PEERS = BENCH / "peers"
SIM_PROFILE = ROOT / "strata" / "sim" / "profiles" / "smollm2-cpu.json"
SIM_MODEL = "sim-smollm2"
REAL_MODEL = "SmolLM2-135M-Instruct"
WORDS = ("river stone cloud garden lamp violin orbit copper meadow signal harbor ember "
         "lantern pepper quartz willow canyon falcon velvet").split()


def start_instance(name: str, log_dir: Path, *, simulate: Path | None, model_name: str,
                   extra: tuple[str, ...] = ()) -> Proc:
    port = free_port()
    argv = [PY, "-m", "strata.cli", "serve", "--port", str(port), "--log-level", "warning",
            "--served-model-name", model_name, *extra]
    if simulate is not None:
        argv += ["--simulate", str(simulate)]
    return spawn(name, argv, log_dir, f"http://127.0.0.1:{port}")


def start_gateway(name: str, urls: list[str], policy: str, log_dir: Path,
                  extra: tuple[str, ...] = ()) -> Proc:
    port = free_port()
    argv = [PY, "-m", "strata.cli", "gateway", "--port", str(port), "--policy", policy,
            "--log-level", "warning", "--instances", *urls, *extra]
    return spawn(name, argv, log_dir, f"http://127.0.0.1:{port}")


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


# ---------------------------------------------------------------- load (shared)

def prompts(n: int, seed: int = 0) -> list[str]:
    """Short distinct text prompts (about 10 tokens)."""
    return [f"{i}: " + " ".join(WORDS[(i * 7 + k * 3 + seed) % len(WORDS)] for k in range(8))
            for i in range(n)]


async def _drive(urls: list[str], model: str, n: int, concurrency: int, max_tokens: int,
                 timeout_s: float, headers: dict[str, str] | None) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    clients = [httpx.AsyncClient(base_url=u, limits=limits, timeout=timeout, headers=headers)
               for u in urls]
    turn = itertools.count()
    results: list[RequestResult] = []

    def job(prompt: str) -> Job:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        async def one() -> None:
            client = clients[next(turn) % len(clients)]  # chosen when it starts: round robin
            result, _ = await stream_request(client, "/v1/completions", body)
            results.append(result)
        return one

    start = time.perf_counter()
    await run_closed_loop([job(p) for p in prompts(n)], concurrency, timeout_s)
    duration = time.perf_counter() - start
    for c in clients:
        await c.aclose()
    results += [RequestResult(error="not finished in time")] * (n - len(results))
    return summarize(results, duration)


def drive(urls: list[str], model: str, n: int, concurrency: int, max_tokens: int = 32,
          timeout_s: float = 120.0, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Stream `n` completions (round robin over `urls`) with `concurrency` in flight, each with
    `headers` (e.g. a client key)."""
    return asyncio.run(_drive(urls, model, n, concurrency, max_tokens, timeout_s, headers))


# ---------------------------------------------------------------- peers

def start_nginx(urls: list[str], log_dir: Path) -> Proc:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise RuntimeError("nginx is not installed (apt-get install -y nginx)")
    port = free_port()
    prefix = Path(tempfile.mkdtemp(prefix="nginx-", dir=BENCH / "tmp"))
    servers = "".join(f"    server {u.removeprefix('http://')};\n" for u in urls)
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = (f"{user}worker_processes 1;\ndaemon off;\npid {prefix}/nginx.pid;\n"
            f"error_log {prefix}/error.log warn;\nevents {{ worker_connections 4096; }}\n"
            f"http {{\n  access_log off;\n  client_body_temp_path {prefix}/body;\n"
            f"  proxy_temp_path {prefix}/proxy;\n  fastcgi_temp_path {prefix}/fcgi;\n"
            f"  uwsgi_temp_path {prefix}/uwsgi;\n  scgi_temp_path {prefix}/scgi;\n"
            f"  upstream strata {{\n    least_conn;\n{servers}    keepalive 128;\n  }}\n"
            f"  server {{\n    listen 127.0.0.1:{port};\n    location / {{\n"
            f"      proxy_pass http://strata;\n      proxy_http_version 1.1;\n"
            f"      proxy_set_header Connection \"\";\n      proxy_buffering off;\n"
            f"      proxy_read_timeout 600s;\n    }}\n  }}\n}}\n")
    (prefix / "nginx.conf").write_text(conf)
    proc = spawn("nginx", [nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf")],
                 log_dir, f"http://127.0.0.1:{port}")
    wait_http(proc, "/v1/models", 20)
    return proc


def start_rust_router(kind: str, urls: list[str], log_dir: Path) -> Proc:
    port, prom = free_port(), free_port()
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
              "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(prom), "--log-level"]
    if kind == "sglang-router":
        exe = PEERS / "sglang" / "bin" / "sglang-router"
        argv = [str(exe), "launch", *common, "warn"]
    else:
        exe = PEERS / "vllmr" / "bin" / "vllm-router"
        argv = [str(exe), *common, "warning"]
    if not exe.exists():
        raise RuntimeError(f"{exe} missing: python3 -m venv {exe.parent.parent} && "
                           f"{exe.parent}/pip install {kind}")
    proc = spawn(kind, argv, log_dir, f"http://127.0.0.1:{port}")
    wait_http(proc, "/health", 60)
    return proc


def start_path(path: str, urls: list[str], log_dir: Path) -> Proc:
    if path.startswith("strata-"):
        proc = start_gateway(path, urls, path.removeprefix("strata-"), log_dir)
        wait_http(proc, "/ready", 30)
        return proc
    if path == "nginx":
        return start_nginx(urls, log_dir)
    return start_rust_router(path, urls, log_dir)


def smoke(url: str, model: str, headers: dict[str, str] | None = None) -> None:
    """One streamed request must produce exactly 4 tokens, or the path is unusable."""
    s = drive([url], model, 1, 1, max_tokens=4, timeout_s=60, headers=headers)
    if s["num_completed"] != 1 or s["total_output_tokens"] != 4:
        raise RuntimeError(f"smoke request failed: {s['errors'] or s['total_output_tokens']}")


# ---------------------------------------------------------------- gateway histogram

def scrape_histogram(url: str, name: str = "strata:gateway_added_latency_seconds"
                     ) -> dict[str, float]:
    """{le: cumulative count, "sum": s, "count": n} of one Prometheus histogram."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := re.match(rf'{re.escape(name)}_bucket{{le="([^"]+)"}} (\S+)', line):
            out[m.group(1)] = float(m.group(2))
        elif m := re.match(rf"{re.escape(name)}_(sum|count) (\S+)", line):
            out[m.group(1)] = float(m.group(2))
    return out


def histogram_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def histogram_summary(h: dict[str, float]) -> dict[str, Any]:
    """Mean and the bucket bounds holding p50/p99 (upper bounds, as Prometheus reports)."""
    n = h.get("count", 0.0)
    buckets = sorted(((float(k), v) for k, v in h.items() if k not in ("sum", "count")),
                     key=lambda kv: kv[0])

    def upper(q: float) -> float | None:
        return next((le for le, c in buckets if n and c >= q * n), None)

    return {"count": int(n), "mean_ms": 1000 * h.get("sum", 0.0) / n if n else None,
            "p50_le_ms": _ms(upper(0.5)), "p99_le_ms": _ms(upper(0.99)),
            "buckets_ms": {f"{1000 * le:g}": int(c) for le, c in buckets if le != float("inf")}}


def _ms(s: float | None) -> float | None:
    return None if s is None else 1000 * s


# ---------------------------------------------------------------- one phase

LATENCY_TOKENS = 8
PATHS = ("direct", "strata-round_robin", "strata-power_of_two", "nginx", "sglang-router",
         "vllm-router")


@dataclass
class Phase:
    name: str
    model: str
    num_requests: int
    concurrency: int
    max_tokens: int
    repeats: int
    latency_requests: int = 40  # the same paths at concurrency 1, LATENCY_TOKENS each
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    latency_runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    gateway_hist: dict[str, dict[str, float]] = field(default_factory=dict)


def start_instances(phase: str, log_dir: Path, quick: bool) -> list[Proc]:
    procs: list[Proc] = []
    for i in range(2):
        if phase == "simulated":
            procs.append(start_instance(f"sim-{i}", log_dir, simulate=SIM_PROFILE,
                                        model_name=SIM_MODEL))
        else:
            procs.append(start_instance(f"real-{i}", log_dir, simulate=None,
                                        model_name=REAL_MODEL,
                                        extra=("--threads", "1", "--kv-cache-gb", "0.2")))
    for p in procs:
        wait_http(p, "/v1/models", 60 if phase == "simulated" else 300)
    return procs


def start_paths(phase: Phase, urls: list[str], log_dir: Path) -> dict[str, Proc]:
    started: dict[str, Proc] = {}
    for path in PATHS[1:]:
        try:
            proc = start_path(path, urls, log_dir)
            started[path] = proc
            smoke(proc.url, phase.model)
        except Exception as e:  # record why, go on with the others
            phase.unavailable[path] = f"{type(e).__name__}: {e}"[-1500:]
            print(f"[{phase.name}] {path} unavailable: {phase.unavailable[path]}", flush=True)
            if path in started:
                started.pop(path).stop()
    return started


def run_phase(phase: Phase, log_dir: Path, quick: bool) -> None:
    procs = start_instances(phase.name, log_dir, quick)
    urls = [p.url for p in procs]
    paths: dict[str, Proc] = {}
    try:
        smoke(urls[0], phase.model)
        paths = start_paths(phase, urls, log_dir)
        targets = {"direct": urls, **{k: [p.url] for k, p in paths.items()}}
        for rep in range(phase.repeats):
            for path, turls in targets.items():  # interleaved: A B C ... per repeat
                run_one(phase, path, turls, paths.get(path), rep)
    finally:
        stop_all([*paths.values(), *procs])


def run_one(phase: Phase, path: str, urls: list[str], proc: Proc | None, rep: int) -> None:
    drive(urls, phase.model, 8, 8, phase.max_tokens)  # warm-up: connections, caches
    is_gateway = path.startswith("strata-")
    before = scrape_histogram(urls[0]) if is_gateway else {}
    lat = drive(urls, phase.model, phase.latency_requests, 1, LATENCY_TOKENS, timeout_s=300)
    phase.latency_runs.setdefault(path, []).append(lat)
    s = drive(urls, phase.model, phase.num_requests, phase.concurrency, phase.max_tokens,
              timeout_s=300)
    s["load_average_1m"] = load_average()[0]
    if is_gateway:
        delta = histogram_delta(scrape_histogram(urls[0]), before)
        acc = phase.gateway_hist.setdefault(path, {})
        for k, v in delta.items():
            acc[k] = acc.get(k, 0.0) + v
    phase.runs.setdefault(path, []).append(s)
    print(f"[{phase.name} r{rep}] {path:<20} c1 ttft p50 {lat['ttft_ms']['p50']:6.2f} ms  "
          f"c{phase.concurrency} ttft p50 {s['ttft_ms']['p50']:7.2f} ms  "
          f"itl p99 {s['itl_ms']['p99']:7.2f} ms  {s['output_tokens_per_s']:8.1f} tok/s  "
          f"{s['requests_per_s']:6.2f} req/s  fail {s['num_failures']}", flush=True)


# ---------------------------------------------------------------- summary

def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_phase(phase: Phase) -> dict[str, Any]:
    direct = phase.runs.get("direct", [])
    lat_direct = phase.latency_runs.get("direct", [])
    rows: dict[str, Any] = {}
    for path, runs in phase.runs.items():
        pairs = list(zip(runs, direct, strict=False))
        lat = phase.latency_runs[path]
        rows[path] = {
            "c1_ttft_p50_ms": _spread([r["ttft_ms"]["p50"] for r in lat]),
            "c1_added_ttft_p50_ms": _spread([r["ttft_ms"]["p50"] - d["ttft_ms"]["p50"]
                                             for r, d in zip(lat, lat_direct, strict=False)]),
            "c1_itl_p50_ms": _spread([r["itl_ms"]["p50"] for r in lat]),
            "ttft_p50_ms": _spread([r["ttft_ms"]["p50"] for r in runs]),
            "itl_p99_ms": _spread([r["itl_ms"]["p99"] for r in runs]),
            "output_tokens_per_s": _spread([r["output_tokens_per_s"] for r in runs]),
            "requests_per_s": _spread([r["requests_per_s"] for r in runs]),
            "failures": sum(r["num_failures"] for r in runs),
            "added_ttft_p50_ms": _spread([r["ttft_ms"]["p50"] - d["ttft_ms"]["p50"]
                                          for r, d in pairs]),
            "throughput_loss_pct": _spread([100 * (1 - r["output_tokens_per_s"]
                                                   / d["output_tokens_per_s"])
                                            for r, d in pairs]),
        }
    return {"rows": rows, "targets": targets(rows),
            "gateway_added_latency": {k: histogram_summary(h)
                                      for k, h in phase.gateway_hist.items()}}


def targets(rows: dict[str, Any]) -> dict[str, Any]:
    """Added TTFT p50 <= 1 ms (at concurrency 1, where queueing does not hide it), throughput
    loss <= 5 % (at full concurrency), added TTFT within 1.5x of the best Rust router's."""
    rust = {k: rows[k]["c1_added_ttft_p50_ms"]["median"] for k in ("sglang-router",
            "vllm-router") if k in rows}
    out: dict[str, Any] = {}
    for path in ("strata-round_robin", "strata-power_of_two"):
        if path not in rows:
            continue
        added = rows[path]["c1_added_ttft_p50_ms"]["median"]
        loss = rows[path]["throughput_loss_pct"]["median"]
        best = min(rust.values()) if rust else None
        out[path] = {
            "added_ttft_p50_ms": round(added, 3), "added_ttft_ok": added <= 1.0,
            "throughput_loss_pct": round(loss, 2), "throughput_ok": loss <= 5.0,
            "rust_added_ttft_p50_ms": {k: round(v, 3) for k, v in rust.items()},
            "ratio_vs_best_rust": round(added / best, 2) if best and best > 0.05 else None,
            "within_1_5x_rust": None if best is None else added <= 1.5 * max(best, 0.0)}
    return out


def print_table(name: str, summary: dict[str, Any]) -> None:
    print(f"\n== {name} ==  (medians over repeats; [min..max] of the added TTFT at c=1)")
    print(f"{'path':<21}{'c1 TTFT':>9}{'+c1 TTFT':>10}{'TTFT p50':>10}{'ITL p99':>9}"
          f"{'tok/s':>9}{'req/s':>8}{'+TTFT p50':>11}{'tput loss':>10}{'fail':>5}")
    for path, r in summary["rows"].items():
        a, c = r["added_ttft_p50_ms"], r["c1_added_ttft_p50_ms"]
        print(f"{path:<21}{r['c1_ttft_p50_ms']['median']:>9.2f}{c['median']:>+10.2f}"
              f"{r['ttft_p50_ms']['median']:>10.2f}{r['itl_p99_ms']['median']:>9.2f}"
              f"{r['output_tokens_per_s']['median']:>9.1f}{r['requests_per_s']['median']:>8.2f}"
              f"{a['median']:>+11.2f}{r['throughput_loss_pct']['median']:>+9.1f}%"
              f"{r['failures']:>5}   [{c['min']:+.2f}..{c['max']:+.2f}]")
    for path, h in summary["gateway_added_latency"].items():
        mean = h["mean_ms"] if h["mean_ms"] is not None else float("nan")
        print(f"{path} /metrics added latency: n={h['count']} mean={mean:.3f} ms "
              f"p50<={h['p50_le_ms']} ms p99<={h['p99_le_ms']} ms")
    for path, t in summary["targets"].items():
        print(f"{path} targets: {json.dumps(t)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, small runs")
    ap.add_argument("--skip-real", action="store_true", help="simulated instances only")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    (BENCH / "tmp").mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_dir = BENCH / "logs" / "gateway_overhead"
    reps = 1 if args.quick else args.repeats
    phases = [Phase("simulated", SIM_MODEL, 48 if args.quick else 200, 16, 32, reps,
                    latency_requests=16 if args.quick else 40)]
    if not args.skip_real:
        phases.append(Phase("real", REAL_MODEL, 16 if args.quick else 64, 16 if not args.quick
                            else 8, 32, reps, latency_requests=8 if args.quick else 20))
    report: dict[str, Any] = {"load_average_start": load_average(), "cpus": os.cpu_count(),
                              "phases": {}}
    for phase in phases:
        print(f"--- phase {phase.name}: {phase.num_requests} req x {phase.max_tokens} tok, "
              f"concurrency {phase.concurrency}, {phase.repeats} repeat(s); load "
              f"{load_average()}", flush=True)
        run_phase(phase, log_dir, args.quick)
        summary = summarize_phase(phase)
        report["phases"][phase.name] = {
            "workload": {"num_requests": phase.num_requests, "concurrency": phase.concurrency,
                         "max_tokens": phase.max_tokens, "repeats": phase.repeats,
                         "latency_requests": phase.latency_requests,
                         "latency_tokens": LATENCY_TOKENS},
            "unavailable": phase.unavailable, "runs": phase.runs,
            "latency_runs": phase.latency_runs, **summary}
        print_table(phase.name, summary)
    report["load_average_end"] = load_average()
    out = RESULTS / "gateway_overhead.json"
    out.write_text(json.dumps(json_safe(report), indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
