"""`strata plan`'s predictions against measurements on this machine (slow; not in CI).

    .venv/bin/python bench/plan_vs_measured.py                 # calibrate, then every config
    .venv/bin/python bench/plan_vs_measured.py --profile P.json --only real1-c1 sim8-p2c

Each configuration runs for real (fresh processes, cold caches), then `strata.plan.simulate`
predicts it from a latency profile: by default one fitted first by `strata profile --threads 1`
on this machine, under its present load (the instances run one torch thread each); the
simulated fleet is predicted from the profile its instances run (smollm2-cpu). The planner's
workload is the one sent: the same lengths, load and sessions; for chats the token counts of
the template and the default system prompt are read from the first session's usage (counts, not
times). Printed: TTFT and TPOT median and p90, predicted against measured, and the error.

Configurations:
    real1-c1        one real instance, 128 -> 32 tokens, one request at a time
    real1-c4        one real instance, the same, 4 at once
    real2-rr-c4     two real instances behind `strata gateway --policy round_robin`, 4 at once
    real2-rr-chat   two real instances, chat sessions (server-side history in a SQLite store),
                    `--session-routing external`, round robin: a turn hits its history only
                    when it lands where the last one ran
    real2-sticky-chat  the same with `--session-routing sticky`
    sim8-p2c        8 simulated instances (`strata serve --simulate smollm2-cpu`) behind
                    power_of_two, Poisson arrivals
Results: .bench/results/plan_vs_measured.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from plan_calibrate import calibrate_overhead, describe
from procs import ROOT, Proc, spawn, stop_all, wait_http

from strata.bench.loadgen import poisson_arrivals, run_closed_loop, stream_request, token_pool
from strata.bench.report import RequestResult, percentile
from strata.bench.workloads import random_words
from strata.cluster.ports import free_port
from strata.plan import Architecture, Costs, LengthDist, PlanInputs, Slo, Workload, simulate
from strata.sim.profile import LatencyProfile, load_profile

RESULTS = ROOT / ".bench" / "results" / "plan_vs_measured.json"
LOGS = ROOT / ".bench" / "logs" / "plan_vs_measured"


@dataclass(frozen=True)
class Config:
    name: str
    fleet: str  # real or sim
    replicas: int
    policy: str = "round_robin"
    sessions: str | None = None  # external or sticky: chat turns with X-Session-Id
    concurrency: int | None = None
    rate: float | None = None
    num_requests: int = 24
    input_len: int = 128
    output_len: int = 32
    num_turns: int = 1


CONFIGS = (
    Config("real1-c1", "real", 1, concurrency=1, num_requests=12),
    Config("real1-c4", "real", 1, concurrency=4),
    Config("real2-rr-c4", "real", 2, concurrency=4),
    Config("real2-rr-chat", "real", 2, sessions="external", concurrency=4, num_requests=24,
           input_len=48, output_len=16, num_turns=6),
    Config("real2-sticky-chat", "real", 2, policy="consistent_hash", sessions="sticky",
           concurrency=4, num_requests=24, input_len=48, output_len=16, num_turns=6),
    Config("sim8-p2c", "sim", 8, policy="power_of_two", rate=12.0, num_requests=150),
    # the workload of docs/evolution.md: chat sessions at 16 turns/s on simulated instances
    Config("evo-1", "sim", 1, sessions="external", rate=16.0, num_requests=240, input_len=48,
           output_len=32, num_turns=4),
    Config("evo-3rr", "sim", 3, sessions="external", rate=16.0, num_requests=240,
           input_len=48, output_len=32, num_turns=4),
    Config("evo-3sticky", "sim", 3, policy="consistent_hash", sessions="sticky", rate=16.0,
           num_requests=240, input_len=48, output_len=32, num_turns=4),
)


def start_fleet(config: Config, log_dir: Path, store: str | None) -> tuple[str, list[Proc]]:
    procs: list[Proc] = []
    try:
        for k in range(config.replicas):
            port = free_port()
            model = ["--simulate", "smollm2-cpu"] if config.fleet == "sim" else ["smollm2"]
            argv = [sys.executable, "-m", "strata.cli", "serve", *model, "--port", str(port),
                    "--threads", "1", "--served-model-name", "m", "--log-level", "warning",
                    *(["--session-store", store] if store else [])]
            procs.append(spawn(f"{config.name}-i{k}", argv, log_dir, f"http://127.0.0.1:{port}"))
        for proc in procs:
            wait_http(proc, "/v1/models", 300)
        if config.replicas == 1:
            return procs[0].url, procs
        port = free_port()
        argv = [sys.executable, "-m", "strata.cli", "gateway", "--port", str(port),
                "--instances", *[p.url for p in procs], "--policy", config.policy,
                "--log-level", "warning"]
        if config.sessions:
            argv += ["--session-routing", config.sessions, "--session-store", store or ""]
        gateway = spawn(f"{config.name}-gw", argv, log_dir, f"http://127.0.0.1:{port}")
        procs.append(gateway)
        wait_http(gateway, "/ready", 60)
        return gateway.url, procs
    except BaseException:
        stop_all(procs)
        raise


async def measure(url: str, config: Config, seed: int,
                  session0: list[int]) -> list[RequestResult]:
    """The results of every request; `session0` gets the first session's prompt tokens."""
    results: list[RequestResult] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        if config.sessions:
            jobs = _chat_jobs(client, config, seed, results, session0)
        else:
            pool = await token_pool(client, "m", seed)
            rng = random.Random(seed)
            jobs = [_completion(client, [rng.choice(pool) for _ in range(config.input_len)],
                                config.output_len, results) for _ in range(config.num_requests)]
        if config.concurrency is not None:
            await run_closed_loop(jobs, config.concurrency, 900)
        else:
            assert config.rate is not None
            starts = poisson_arrivals(len(jobs), config.rate / config.num_turns, seed)
            t0 = time.perf_counter()

            async def at(delay: float, job: Any) -> None:
                await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
                await job()

            await asyncio.gather(*(at(d, j) for d, j in zip(starts, jobs, strict=True)))
    return results


def _completion(client: httpx.AsyncClient, prompt: list[int], output_len: int,
                results: list[RequestResult]) -> Any:
    body = {"model": "m", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def job() -> None:
        result, _ = await stream_request(client, "/v1/completions", body)
        results.append(result)

    return job


def _chat_jobs(client: httpx.AsyncClient, config: Config, seed: int,
               results: list[RequestResult], session0: list[int]) -> list[Any]:
    rng, run = random.Random(seed), uuid.uuid4().hex[:8]
    num_sessions = config.num_requests // config.num_turns

    def session(s: int) -> Any:
        turns = [random_words(rng, config.input_len) for _ in range(config.num_turns)]

        async def job() -> None:
            for text in turns:
                body = {"model": "m", "messages": [{"role": "user", "content": text}],
                        "max_tokens": config.output_len, "temperature": 0.0,
                        "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}, "session_id": f"{run}-{s}"}
                result, _ = await stream_request(client, "/v1/chat/completions", body)
                results.append(result)
                if s == 0:
                    session0.append(result.prompt_tokens)

        return job

    return [session(s) for s in range(num_sessions)]


def planned_workload(config: Config, session0: list[int]) -> Workload:
    load: dict[str, Any] = ({"concurrency": config.concurrency} if config.concurrency
                            else {"rate_per_s": config.rate})
    out = LengthDist(config.output_len, config.output_len)
    if not config.sessions:
        return Workload(num_requests=config.num_requests, output=out, **load,
                        prompt=LengthDist(config.input_len, config.input_len))
    user = max(1, session0[1] - session0[0] - config.output_len)  # a message, templated
    return Workload(num_requests=config.num_requests, output=out, num_turns=config.num_turns,
                    prompt=LengthDist(user, user), prefix_tokens=max(0, session0[0] - user),
                    **load)


def predict(config: Config, workload: Workload, profile: LatencyProfile,
            overhead_ms: list[float] | None = None) -> dict[str, Any]:
    """The planner's TTFT and TPOT for `config` (the SLO is irrelevant: nothing stops early);
    with `overhead_ms`, the calibrated per-request overhead (plan_calibrate.py), which for chat
    turns includes the session store, else the constants of the first run."""
    arch = Architecture("replicas" if config.replicas > 1 else "one process",
                        replicas=config.replicas, policy=config.policy,
                        sessions=config.sessions)
    costs = (Costs(request_overhead_samples_ms=tuple(overhead_ms), session_read_ms=0.0)
             if overhead_ms else Costs(request_overhead_ms=4.0 if config.replicas > 1 else 2.0))
    out, _ = simulate(arch, PlanInputs(workload, Slo(1e9, 1e9), profile, costs=costs))
    return {"ttft_ms": out.ttft_ms, "tpot_ms": out.tpot_ms, "wall_s": out.wall_s}


def measured_stats(results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.is_ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    return {"ttft_ms": {f"p{q}": percentile(ttft, q) * 1000 for q in (50, 90)},
            "tpot_ms": {f"p{q}": percentile(tpot, q) * 1000 for q in (50, 90)},
            "num_ok": len(ok), "num_failed": len(results) - len(ok)}


def calibrate(path: Path) -> LatencyProfile:
    started = time.perf_counter()
    argv = [sys.executable, "-m", "strata.cli", "profile", "smollm2", "--out", str(path),
            "--threads", "1", "--max-batch", "16"]
    import subprocess

    subprocess.run(argv, check=True, cwd=ROOT, capture_output=True, text=True)
    print(f"calibrated {path} in {time.perf_counter() - started:.0f} s", flush=True)
    return load_profile(str(path))


def error_pct(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured * 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="skip calibration: use this profile")
    ap.add_argument("--only", nargs="*", default=None, help="config names")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS), help="the results' JSON file")
    ap.add_argument("--no-calibrate-overhead", action="store_true",
                    help="charge the constant overheads of the first run (2 ms, 4 via a gateway)")
    args = ap.parse_args()
    LOGS.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    real = load_profile(args.profile) if args.profile else calibrate(
        ROOT / ".bench" / "results" / "plan_profile.json")
    rows = []
    for config in CONFIGS:
        if args.only and config.name not in args.only:
            continue
        store = f"sqlite:///{LOGS / (config.name + '.db')}" if config.sessions else None
        url, procs = start_fleet(config, LOGS, store)
        session0: list[int] = []
        profile = load_profile("smollm2-cpu") if config.fleet == "sim" else real
        try:
            overhead = [] if args.no_calibrate_overhead else asyncio.run(calibrate_overhead(
                url, profile, is_chat=config.sessions is not None))
            if overhead:
                print(f"{config.name}: {describe(overhead)}", flush=True)
            results = asyncio.run(measure(url, config, args.seed, session0))
        finally:
            stop_all(procs)
        quiet = load_profile("smollm2-cpu")
        workload = planned_workload(config, session0)
        row = {"config": config.name, "load_average": os.getloadavg()[0],
               "workload": workload.describe(), "measured": measured_stats(results),
               "overhead_ms": overhead,
               "predicted": predict(config, workload, profile, overhead),
               "predicted_constant_overhead": predict(config, workload, profile),
               "predicted_quiet": predict(config, workload, quiet)}
        rows.append(row)
        print_row(row)
        out = Path(args.out)  # after every row: a run cut short keeps what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": rows, "profile": real.source}, indent=2) + "\n")
    print_table(rows)


def print_row(row: dict[str, Any]) -> None:
    m, p = row["measured"], row["predicted"]
    print(f"{row['config']}: TTFT p50 {p['ttft_ms']['p50']:.0f} vs {m['ttft_ms']['p50']:.0f}, "
          f"TPOT p50 {p['tpot_ms']['p50']:.1f} vs {m['tpot_ms']['p50']:.1f} "
          f"(load {row['load_average']:.1f}, {m['num_failed']} failed)", flush=True)


def print_table(rows: list[dict[str, Any]]) -> None:
    """Markdown: measured, predicted with the calibrated overhead, and with the constant one
    (the first run's 2-4 ms); error = (predicted - measured) / measured."""
    print("| config | metric | measured p50 | predicted p50 | error | constant-overhead p50 | "
          "error | measured p90 | predicted p90 | error | constant-overhead p90 | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"predicted": [], "predicted_constant_overhead": []}
    for row in rows:
        for metric in ("ttft_ms", "tpot_ms"):
            m, cells = row["measured"][metric], []
            for q in ("p50", "p90"):
                for kind, found in errors.items():
                    p = row[kind][metric][q]
                    found.append(abs(error_pct(p, m[q])))
                    cells += ([f"{m[q]:.1f}"] if kind == "predicted" else []) + [
                        f"{p:.1f}", f"{error_pct(p, m[q]):+.0f} %"]
            print(f"| {row['config']} | {metric[:4].upper()} ms | " + " | ".join(cells) + " |")
    for kind, found in errors.items():
        if found:
            print(f"{kind}: median |error| {statistics.median(found):.0f} %, "
                  f"max {max(found):.0f} %")


if __name__ == "__main__":
    main()
