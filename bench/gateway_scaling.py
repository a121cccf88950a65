"""Gateway scaling: 1, 2, 4 ... 64 simulated instances behind one Strata gateway.

    .venv/bin/python bench/gateway_scaling.py [--quick]

Every instance is a `strata serve --simulate` process (a synthetic 20 ms/step profile); the
gateway (`strata gateway --instances ...`, power_of_two) is restarted for each N with the first N
URLs. Offered load scales with N (PER_INSTANCE streams in flight per instance, closed loop), so
every instance is equally busy. Reported per N: requests/s, SSE events/s, efficiency =
throughput(N) / (N * throughput(1)), and CPU of the gateway, of this client and of all instances
(from /proc/PID/stat). The gateway's ceiling per core = events (or requests) / gateway CPU-seconds.
At the largest N the gateway is profiled with py-spy (collapsed stacks, summarized by frame).
Writes .bench/results/gateway_scaling.json (+ the raw py-spy profile).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from gateway_overhead import BENCH, RESULTS, ROOT, load_average, start_gateway, start_instance
from procs import Proc, stop_all, wait_http

from strata.bench.loadgen import run_closed_loop
from strata.bench.report import latency_stats_ms
from strata.sim.profile import LatencyProfile

MODEL = "sim-scale"
PROFILE = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=2.0,
                         prefill_ms_per_token=0.05, decode_ms_base=20.0, decode_ms_per_seq=0.2)
PER_INSTANCE = 4  # streams in flight per instance
MAX_TOKENS = 32
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of a process (its own threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def _one(client: httpx.AsyncClient, i: int, out: list[dict[str, Any]]) -> None:
    body = {"model": MODEL, "prompt": f"{i} scale test prompt", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True}
    start, events, ttft, tail, error = time.perf_counter(), 0, None, b"", ""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            ok = resp.status_code == 200
            error = "" if ok else f"HTTP {resp.status_code}"
            async for chunk in resp.aiter_raw():
                ttft = ttft if ttft is not None else time.perf_counter() - start
                buf = tail + chunk  # count "data: " even when split across reads
                events += buf.count(b"data: ")
                if b'{"error"' in buf:  # the SSE error event of a broken stream
                    ok, error = False, "SSE error event"
                tail = buf[-5:]
    except httpx.HTTPError as e:
        ok, error = False, type(e).__name__
    out.append({"ok": ok and events > 1, "events": events, "ttft_s": ttft, "error": error})


async def _lean_drive(url: str, n: int, concurrency: int, timeout_s: float
                      ) -> tuple[list[dict[str, Any]], float]:
    """Closed loop, no JSON parsing (a cheap client leaves the CPU to the gateway)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, limits=limits,
                                 timeout=httpx.Timeout(timeout_s)) as client:
        jobs = [functools.partial(_one, client, i, out) for i in range(n)]
        start = time.perf_counter()
        await run_closed_loop(jobs, concurrency, timeout_s)
        return out, time.perf_counter() - start


def measure(gateway: Proc, instances: list[Proc], n_req: int, concurrency: int
            ) -> dict[str, Any]:
    pids = [p.pid for p in instances]
    before = (cpu_s(gateway.pid), sum(cpu_s(p) for p in pids), time.process_time())
    results, wall = asyncio.run(_lean_drive(gateway.url, n_req, concurrency, 180.0))
    after = (cpu_s(gateway.pid), sum(cpu_s(p) for p in pids), time.process_time())
    ok = [r for r in results if r["ok"]]
    events = sum(r["events"] for r in ok)
    gw_cpu = after[0] - before[0]
    errors = Counter(r["error"] or "no events" for r in results if not r["ok"])
    return {"errors": dict(errors),
        "wall_s": wall, "completed": len(ok), "failed": n_req - len(ok),
        "requests_per_s": len(ok) / wall, "events_per_s": events / wall,
        "ttft_ms": latency_stats_ms([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "gateway_cpu_cores": gw_cpu / wall, "instances_cpu_cores": (after[1] - before[1]) / wall,
        "client_cpu_cores": (after[2] - before[2]) / wall,
        "gateway_events_per_cpu_s": events / gw_cpu if gw_cpu else None,
        "gateway_requests_per_cpu_s": len(ok) / gw_cpu if gw_cpu else None,
        "load_average_1m": load_average()[0],
    }


def gateway_counters(gateway: Proc) -> dict[str, float]:
    """Totals of the gateway's ejection, retry and error counters (all labels summed)."""
    totals: dict[str, float] = {}
    for line in httpx.get(gateway.url + "/metrics", timeout=10).text.splitlines():
        for name in ("ejections", "retries", "errors", "upstream_failures", "broken_streams"):
            if line.startswith(f"strata:gateway_{name}_total"):
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def grow(instances: list[Proc], n: int, profile: Path, log_dir: Path) -> None:
    """Start instances in batches of 8 until there are n, each ready before the next batch."""
    while len(instances) < n:
        batch = [start_instance(f"sim-{len(instances) + k}", log_dir, simulate=profile,
                                model_name=MODEL) for k in range(min(8, n - len(instances)))]
        instances.extend(batch)
        for p in batch:
            wait_http(p, "/v1/models", 120)


def wait_routable(gateway: Proc, n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = httpx.get(gateway.url + "/admin/instances", timeout=5).json()["instances"]
        if sum(bool(v.get("routable")) for v in views) >= n:
            return
        time.sleep(0.3)
    raise RuntimeError(f"gateway routes to fewer than {n} instances after {timeout_s}s")


CATEGORIES = (("h11", "h11 (HTTP/1.1 parsing, server and client)"),
              ("httpcore", "httpcore (upstream connection pool)"),
              ("httpx", "httpx (upstream client)"), ("anyio", "anyio (httpx/starlette I/O)"),
              ("uvicorn", "uvicorn (server protocol)"), ("starlette", "starlette"),
              ("strata/gateway", "strata.gateway"), ("prometheus_client", "prometheus_client"),
              ("json", "json"), ("asyncio", "asyncio event loop"),
              ("selectors", "selectors (epoll)"), ("socket", "socket"), ("ssl", "ssl"))


def categorize(frame: str) -> str:
    return next((name for key, name in CATEGORIES if key in frame), "other: " + frame[:60])


def summarize_profile(raw: Path, top: int = 15) -> dict[str, Any]:
    """Self time by leaf frame and by library; inclusive time of strata.gateway functions."""
    leaf: Counter[str] = Counter()
    lib: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        leaf[frames[-1]] += n
        lib[categorize(frames[-1])] += n
        for f in set(frames):
            if "strata/gateway" in f or "starlette" in f or "uvicorn" in f or "httpx" in f:
                incl[f] += n

    def pct(c: Counter[str]) -> dict[str, float]:
        return {k: round(100 * v / total, 1) for k, v in c.most_common(top)}

    return {"samples": total, "self_by_library_pct": pct(lib), "self_by_frame_pct": pct(leaf),
            "inclusive_pct": pct(incl)}


def profile_gateway(gateway: Proc, instances: list[Proc], n: int, seconds: int
                    ) -> dict[str, Any]:
    out = RESULTS / f"gateway_scaling_pyspy_N{n}.txt"
    spy = str(ROOT / ".venv" / "bin" / "py-spy")
    cmd = [spy, "record", "-d", str(seconds), "-r", "200", "--nonblocking", "--format", "raw",
           "-p", str(gateway.pid), "-o", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        time.sleep(1.0)
        load = measure(gateway, instances, PER_INSTANCE * n * 12, PER_INSTANCE * n)
        text = proc.communicate(timeout=seconds + 60)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if not out.exists():
        return {"error": text[-1500:], "load": load}
    return {"file": str(out), "load": load, **summarize_profile(out)}


def run_n(n: int, instances: list[Proc], log_dir: Path, repeats: int) -> dict[str, Any]:
    urls = [p.url for p in instances[:n]]
    gateway = start_gateway(f"gateway-N{n}", urls, "power_of_two", log_dir,
                            ("--max-in-flight", "4096", "--max-queue", "4096"))
    try:
        wait_http(gateway, "/ready", 60)
        wait_routable(gateway, n)
        measure(gateway, instances[:n], PER_INSTANCE * n, PER_INSTANCE * n)  # warm-up
        runs = [measure(gateway, instances[:n], PER_INSTANCE * n * 5, PER_INSTANCE * n)
                for _ in range(repeats)]
        counters = gateway_counters(gateway)
    finally:
        gateway.stop()
    medians = {k: statistics.median(r[k] for r in runs) for k in
               ("requests_per_s", "events_per_s", "gateway_cpu_cores", "client_cpu_cores",
                "instances_cpu_cores")}
    return {"n": n, "runs": runs, "gateway_counters": counters, **medians}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 1, 2, 4, 8; 1 repeat")
    ap.add_argument("--max-n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-s", type=int, default=10)
    args = ap.parse_args()
    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= (8 if args.quick else args.max_n)]
    repeats = 1 if args.quick else args.repeats
    log_dir = BENCH / "logs" / "gateway_scaling"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (BENCH / "tmp").mkdir(parents=True, exist_ok=True)
    profile = BENCH / "tmp" / "scaling_profile.json"
    PROFILE.save(profile)
    report: dict[str, Any] = {"load_average_start": load_average(), "cpus": os.cpu_count(),
                              "per_instance_streams": PER_INSTANCE, "max_tokens": MAX_TOKENS,
                              "profile": json.loads(PROFILE.to_json()), "sizes": []}
    instances: list[Proc] = []
    gateway: Proc | None = None
    try:
        for n in sizes:
            grow(instances, n, profile, log_dir)
            row = run_n(n, instances, log_dir, repeats)
            report["sizes"].append(row)
            print_row(row, report["sizes"][0])
        gateway = start_gateway("gateway-profile", [p.url for p in instances], "power_of_two",
                                log_dir, ("--max-in-flight", "4096", "--max-queue", "4096"))
        wait_http(gateway, "/ready", 60)
        wait_routable(gateway, len(instances))
        report["profile_at_max_n"] = profile_gateway(gateway, instances, sizes[-1],
                                                     4 if args.quick else args.profile_s)
    finally:
        stop_all([*instances, *([gateway] if gateway else [])])
    report["load_average_end"] = load_average()
    finish(report)


def efficiency(row: dict[str, Any], first: dict[str, Any]) -> float:
    return row["requests_per_s"] / (row["n"] * first["requests_per_s"])


def print_row(row: dict[str, Any], first: dict[str, Any]) -> None:
    row["efficiency"] = efficiency(row, first)
    runs = row["runs"]
    ev_cpu = statistics.median(r["gateway_events_per_cpu_s"] or 0 for r in runs)
    rq_cpu = statistics.median(r["gateway_requests_per_cpu_s"] or 0 for r in runs)
    row["gateway_events_per_cpu_s"], row["gateway_requests_per_cpu_s"] = ev_cpu, rq_cpu
    rps = [r["requests_per_s"] for r in runs]
    print(f"N={row['n']:>3} {row['requests_per_s']:8.1f} req/s [{min(rps):.1f}..{max(rps):.1f}]"
          f" {row['events_per_s']:9.0f} ev/s  eff {100 * row['efficiency']:5.1f}%  "
          f"cpu gw {row['gateway_cpu_cores']:.2f} client {row['client_cpu_cores']:.2f} "
          f"inst {row['instances_cpu_cores']:.2f}  gw ceiling {rq_cpu:.0f} req/s, "
          f"{ev_cpu:.0f} ev/s per core  fail {sum(r['failed'] for r in runs)} "
          f"{row.get('gateway_counters')}", flush=True)


def finish(report: dict[str, Any]) -> None:
    prof = report.get("profile_at_max_n", {})
    print("\npy-spy at max N:", json.dumps({k: prof.get(k) for k in
          ("samples", "self_by_library_pct", "error")}, indent=1))
    out = RESULTS / "gateway_scaling.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
