"""Priority classes under overload: interactive TTFT, refusals, batch wait, throughput vs FCFS.

    .venv/bin/python bench/priority.py [--real] [--seconds 60]

A fleet behind `strata up` (default: 4 simulated instances of a synthetic profile with 4 running
slots and ~1 s answers; --real: one instance of the default model). First the fleet's capacity
is measured (closed loop, every slot busy, completions/s). Then, with open-loop Poisson
arrivals of streamed 20-token completions:
- unloaded: the interactive share alone (0.6x capacity), classes on: interactive TTFT p99;
- FCFS: 2x capacity, 30 % interactive / 70 % batch, all sent without a priority (plain gateway);
- priority: the same load with X-Priority, gateway `--instance-slots` = the slots + 2 (one
  request waits in each engine, so a finished one is replaced at once; the engine puts
  interactive ones first and preempts batch ones for them) and `--batch-max-queue 32`,
  engines with their default aging (30 s).
Per class: sent, answered, refused (429/503), TTFT p50/p99 of the answered; throughput is the
output tokens answered per second of the load window. Writes .bench/results/priority.json and
docs/img/priority.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from failover import start_cluster, stop_cluster  # noqa: E402
from gateway_overhead import BENCH, RESULTS, ROOT, load_average  # noqa: E402

from strata.sim.profile import LatencyProfile  # noqa: E402

MODEL = "sim-priority"
# 4 running slots, 50 ms a decode step: a 20-token answer takes about 1 s
PROFILE = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=2.0,
                         prefill_ms_per_token=0.1, decode_ms_base=50.0, decode_ms_per_seq=0.5)
MAX_TOKENS = 20


@dataclass
class Sent:
    klass: str
    at: float
    status: int = 0
    ttft_s: float | None = None
    tokens: int = 0
    ended_at: float = 0.0


async def stream(client: httpx.AsyncClient, model: str, klass: str, priority: str | None,
                 out: list[Sent]) -> None:
    sent = Sent(klass, time.monotonic())
    out.append(sent)
    headers = {"x-priority": priority} if priority else {}
    body = {"model": model, "prompt": "tell me about the world", "max_tokens": MAX_TOKENS,
            "stream": True, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers=headers) as resp:
            sent.status = resp.status_code
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    sent.ttft_s = sent.ttft_s or time.monotonic() - sent.at
                    sent.tokens += 1
    except httpx.HTTPError:
        sent.status = sent.status or -1
    sent.ended_at = time.monotonic()


async def open_loop(url: str, model: str, rate: float, seconds: float, mix: dict[str, float],
                    with_priority: bool, seed: int = 0) -> tuple[list[Sent], float, float]:
    rng = random.Random(seed)
    out: list[Sent] = []
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 limits=httpx.Limits(max_connections=1000)) as client:
        tasks, started = [], time.monotonic()
        at = started
        while at < started + seconds:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            klass = rng.choices(list(mix), weights=list(mix.values()))[0]
            tasks.append(asyncio.create_task(stream(
                client, model, klass, klass if with_priority else None, out)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return out, started, started + seconds


async def capacity(url: str, model: str, concurrency: int, seconds: float) -> float:
    """Completions per second with every slot busy (closed loop)."""
    done: list[Sent] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        until = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < until:
                await stream(client, model, "probe", None, done)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finished = [s for s in done if s.status == 200 and s.ended_at <= until]
    return len(finished) / (until - started)


def summarize(sent: list[Sent], start: float, end: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for klass in sorted({s.klass for s in sent}):
        mine = [s for s in sent if s.klass == klass]
        ok = sorted(s.ttft_s for s in mine if s.status == 200 and s.ttft_s is not None)
        out[klass] = {"sent": len(mine), "answered": len(ok),
                      "refused": sum(s.status in (429, 503) for s in mine),
                      "failed_other": sum(s.status not in (200, 429, 503) for s in mine),
                      "ttft_p50_s": round(ok[len(ok) // 2], 3) if ok else None,
                      "ttft_p99_s": round(ok[int(0.99 * (len(ok) - 1))], 3) if ok else None,
                      "ttft_max_s": round(ok[-1], 3) if ok else None}
    in_window = [s for s in sent if s.status == 200 and start <= s.ended_at <= end]
    out["throughput_tokens_per_s"] = round(sum(s.tokens for s in in_window) / (end - start), 1)
    return out


def run_config(name: str, serve: list[str], replicas: int, gateway: list[str], rate: float,
               seconds: float, mix: dict[str, float], with_priority: bool,
               model: str) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"priority-{name}-", dir=BENCH / "tmp"))
    args = [*serve, *(f"--gateway-arg={flag}" for flag in gateway)]
    proc, url, _ = start_cluster(root, args, replicas=replicas)
    try:
        sent, start, end = asyncio.run(open_loop(url, model, rate, seconds, mix, with_priority))
    finally:
        stop_cluster(proc)
    result = summarize(sent, start, end)
    result["rate_rps"] = round(rate, 2)
    print(name, json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--real", action="store_true", help="one real default-model instance")
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    (BENCH / "tmp").mkdir(parents=True, exist_ok=True)
    if args.real:
        replicas, slots, model = 1, 8, "SmolLM2-135M-Instruct"
        serve = ["--max-num-seqs", str(slots)]
    else:
        replicas, slots, model = 4, 4, MODEL
        root = Path(tempfile.mkdtemp(prefix="priority-profile-", dir=BENCH / "tmp"))
        PROFILE.save(root / "profile.json")
        serve = ["--simulate", str(root / "profile.json"), "--served-model-name", MODEL,
                 "--max-num-seqs", str(slots)]
    probe_root = Path(tempfile.mkdtemp(prefix="priority-probe-", dir=BENCH / "tmp"))
    proc, url, _ = start_cluster(probe_root, serve, replicas=replicas)
    try:
        cap = asyncio.run(capacity(url, model, 2 * slots * replicas, 20.0))
    finally:
        stop_cluster(proc)
    print(f"capacity {cap:.2f} requests/s", flush=True)
    classes = ["--instance-slots", str(slots + 2), "--batch-max-queue", "32"]
    mix = {"interactive": 0.3, "batch": 0.7}
    result = {
        "fleet": "real x1" if args.real else "simulated x4", "capacity_rps": round(cap, 2),
        "load_average": load_average(),
        "unloaded": run_config("unloaded", serve, replicas, classes, 0.6 * cap, args.seconds,
                               {"interactive": 1.0}, True, model),
        "fcfs": run_config("fcfs", serve, replicas, [], 2 * cap, args.seconds, mix, False,
                           model),
        "priority": run_config("priority", serve, replicas, classes, 2 * cap, args.seconds,
                               mix, True, model),
        "load_average_after": load_average()}
    name = "priority_real" if args.real else "priority"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, ROOT / "docs" / "img" / f"{name}.png")
    print(json.dumps(result, indent=2))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("unloaded", "interactive"), ("fcfs", "interactive"), ("fcfs", "batch"),
            ("priority", "interactive"), ("priority", "batch")]
    labels = [f"{run}\n{klass}" for run, klass in rows]
    p50 = [result[run][klass]["ttft_p50_s"] or 0 for run, klass in rows]
    p99 = [result[run][klass]["ttft_p99_s"] or 0 for run, klass in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], p50, 0.4, label="TTFT p50")
    ax.bar([i + 0.2 for i in x], p99, 0.4, label="TTFT p99")
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    ax.set_title(f"{result['fleet']}, 2x capacity, 30 % interactive / 70 % batch")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
