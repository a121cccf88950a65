"""P/D against mixed at equal instance count: decode ITL, TTFT by prompt length, throughput.

Each fleet is a `strata up` (its gateway, its instances) driven by the same open-loop workload: a
chat mix where `--long-frac` of the requests carry a long prompt (`--long-len` tokens) and the
rest short chat turns (`--short-len`), every request streaming `--output-len` tokens, Poisson
arrivals at `--rate` requests/s. Prompts are token ids (exact lengths, never repeated: no prefix
cache helps). Fleets are interleaved (mixed, pd, mixed, pd ...) over `--rounds`.

    real instances (default model, one torch thread each):
        .venv/bin/python bench/pd_fleet.py --mixed 2 --prefill 1 --decode 1
    simulated (the smollm2-cpu profile, transfer modeled at the measured 0.5 GB/s):
        .venv/bin/python bench/pd_fleet.py --simulate smollm2-cpu --mixed 16 --prefill 4 \\
            --decode 12 --rate 8 --num-requests 400

Decode ITL is over every gap between two streamed tokens of every request (the streams that a
long prefill on their instance would stall). Writes .bench/results/pd_fleet[-sim].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from procs import Proc, spawn

from strata.bench.loadgen import poisson_arrivals, stream_request, token_pool
from strata.bench.report import RequestResult, percentile
from strata.cluster.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / ".bench" / "results"


def start_fleet(name: str, args: argparse.Namespace, layout: list[str]) -> Proc:
    port = free_port()
    run_dir = Path(tempfile.mkdtemp(prefix=f"pd-fleet-{name}-"))
    argv = [sys.executable, "-m", "strata.cli", "up", "--port", str(port), *layout,
            "--log-level", "warning", "--max-model-len", str(args.long_len + args.output_len + 16)]
    if args.simulate:
        argv += ["--simulate", args.simulate]
    else:
        argv += ["--threads-per-instance", "1"]
    proc = spawn(name, argv, run_dir, f"http://127.0.0.1:{port}",
                 env={**os.environ, "STRATA_RUN_DIR": str(run_dir)})
    expected = sum(int(v) for v in layout[1::2])
    proc.wait_until(lambda: _num_routable(proc.url) >= expected, 600, "every instance routable")
    return proc


def _num_routable(url: str) -> int:
    try:
        views = httpx.get(f"{url}/admin/instances", timeout=2).json()["instances"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(bool(v["routable"]) for v in views)


async def drive(url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        pool = await token_pool(client, model, seed)
        num_long = round(args.long_frac * args.num_requests)  # exactly the mix asked for
        kinds = ["long"] * num_long + ["short"] * (args.num_requests - num_long)
        rng.shuffle(kinds)
        arrivals = poisson_arrivals(args.num_requests, args.rate, seed)
        results: list[tuple[str, RequestResult]] = []

        async def one(kind: str, at: float) -> None:
            await asyncio.sleep(at)
            length = args.long_len if kind == "long" else args.short_len
            body = {"model": model, "prompt": [rng.choice(pool) for _ in range(length)],
                    "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            result, _ = await stream_request(client, "/v1/completions", body)
            results.append((kind, result))

        began = time.perf_counter()
        await asyncio.gather(*(one(k, t) for k, t in zip(kinds, arrivals, strict=True)))
        wall_s = time.perf_counter() - began
        metrics = (await client.get("/metrics")).text
    return summarize(results, wall_s, metrics)


def summarize(results: list[tuple[str, RequestResult]], wall_s: float,
              metrics: str) -> dict[str, Any]:
    ok = [(k, r) for k, r in results if r.is_ok]
    itl = [gap for _, r in ok for gap in r.itl_s]
    short_itl = [gap for k, r in ok if k == "short" for gap in r.itl_s]

    def ms(values: list[float], q: float) -> float:
        return round(percentile(values, q) * 1000, 1) if values else float("nan")

    ttft = {kind: [r.ttft_s for k, r in ok if k == kind and r.ttft_s is not None]
            for kind in ("short", "long")}
    return {
        "requests": len(results), "failed": len(results) - len(ok), "wall_s": round(wall_s, 1),
        "output_tok_s": round(sum(r.output_tokens for _, r in ok) / wall_s, 1),
        "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99), "itl_p999_ms": ms(itl, 99.9),
        "itl_max_ms": round(max(itl) * 1000, 1) if itl else float("nan"),
        "itl_over_100ms_pct": round(100 * sum(g > 0.1 for g in itl) / max(len(itl), 1), 2),
        "short_itl_p50_ms": ms(short_itl, 50), "short_itl_p99_ms": ms(short_itl, 99),
        **{f"ttft_{kind}_p50_ms": ms(v, 50) for kind, v in ttft.items()},
        **{f"ttft_{kind}_p99_ms": ms(v, 99) for kind, v in ttft.items()},
        "remote_prefills": _counter(metrics, 'strata:gateway_pd_prefills_total{outcome="ok"}'),
        **{f"decided_{reason}": _counter(metrics, f'strata:gateway_pd_decisions_total{{reason='
                                                  f'"{reason}"}}')
           for reason in ("remote", "short", "backlog")},
    }


def _counter(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--simulate", default=None, metavar="PROFILE")
    p.add_argument("--mixed", type=int, default=2)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--long-frac", type=float, default=0.2)
    p.add_argument("--short-len", type=int, default=128)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    fleets = {"mixed": ["--replicas", str(args.mixed)],
              "pd": ["--prefill", str(args.prefill), "--decode", str(args.decode)]}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in fleets}
    for round_ in range(args.rounds):
        for name, layout in fleets.items():
            proc = start_fleet(name, args, layout)
            try:
                summary = asyncio.run(drive(proc.url, args, seed=round_))
            finally:
                proc.stop(timeout_s=60)
            summary["load_average"] = [round(x, 2) for x in os.getloadavg()]
            runs[name].append(summary)
            print(name, json.dumps(summary), flush=True)
    report = {"args": vars(args), "runs": runs,
              "median": {name: _median(rs) for name, rs in runs.items()}}
    out = RESULTS / f"pd_fleet{'-sim' if args.simulate else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]
            if isinstance(runs[0][k], (int, float))}


if __name__ == "__main__":
    main()
