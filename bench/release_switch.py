"""A blue-green release under load: TTFT p99 during the switch against steady state, and the
time from "every new instance ready" to "all new traffic on the new version".

    .venv/bin/python bench/release_switch.py [--rounds 3] [--real]

Each round starts a fresh `strata up --replicas 2 --model-version v1` (by default simulated with
the bundled smollm2-cpu profile, labelled simulated: the release mechanism's own cost, with no
CPU contention from starting instances; `--real` serves the default model with one replica, so
the new instance's start competes with the live one for the 2 cores), keeps CONCURRENCY
streams flowing through the gateway, registers v2 and runs `strata release m@v2`. It reports:
- TTFT p50/p99 of the requests started in the STEADY_S before the release, and p99 of those
  started while it ran (target: switch p99 <= 2x steady p99);
- ready -> all new traffic: from the controller's `ready_at` (every new instance ready and
  warmed) to the start of the last request still served by v1, seen by an open-loop probe (one
  1-token request every 10 ms beside the load; target <= 1 s; it includes the gateways' routing
  poll, 0.2 s);
- ready -> flip: from `ready_at` to the atomic write of the live pointer (target < 1 s; the
  tests assert only that the release flips, not how soon);
- the requests that failed, load and probes (target 0). A request succeeds when it is a 200
  whose body (SSE or JSON) has no error event and finishes with `length`
  (harness.checks); a stream cut mid-way ends with an error event and `[DONE]`: failed.
Writes .bench/results/release_switch.json, with each target met or missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from failover import start_cluster, stop_cluster
from gateway_overhead import PY, RESULTS, ROOT, SIM_PROFILE, load_average
from harness.checks import completion_failure

from strata.bench.report import percentile
from strata.registry import create_model_registry
from strata.registry.models import Release

CONCURRENCY = 8
STEADY_S = 8.0
AFTER_S = 3.0
MAX_TOKENS = 32
PROBE_S = 0.01


@dataclass
class Sample:
    started_at: float  # wall clock (the registry's clock)
    ttft_s: float | None
    ok: bool
    version: str


async def one_stream(client: httpx.AsyncClient, model: str, out: list[Sample]) -> None:
    body = {"model": model, "prompt": "Write a short note about the sea.",
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    started_at, t0 = time.time(), time.perf_counter()
    ttft, ok, version = None, False, ""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            version = resp.headers.get("x-model-version", "")
            raw = b""
            async for chunk in resp.aiter_raw():
                if ttft is None and b"data: " in chunk:
                    ttft = time.perf_counter() - t0
                raw += chunk
            ok = completion_failure(resp.status_code, raw, is_stream=True,
                                    finish_reasons={"length"}) is None
    except httpx.HTTPError:
        ok = False
    out.append(Sample(started_at, ttft, ok, version))


async def probe(url: str, model: str, out: list[Sample], stop: asyncio.Event) -> None:
    """Open loop: a one-token request every PROBE_S, whatever the load is doing, so that the
    moment new traffic moves to the new version is seen to PROBE_S."""
    body = {"model": model, "prompt": "probe", "max_tokens": 1}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def one() -> None:
            started_at = time.time()
            try:
                r = await client.post("/v1/completions", json=body)
                ok = completion_failure(r.status_code, r.content, is_stream=False) is None
                out.append(Sample(started_at, None, ok, r.headers.get("x-model-version", "")))
            except httpx.HTTPError:
                out.append(Sample(started_at, None, False, ""))

        tasks = []
        while not stop.is_set():
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(PROBE_S)
        await asyncio.gather(*tasks)


async def keep_loaded(url: str, model: str, out: list[Sample], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def worker() -> None:
            while not stop.is_set():
                await one_stream(client, model, out)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STRATA_RUN_DIR": str(run_dir)}
    return subprocess.run([PY, "-m", "strata.cli", *args], env=env, cwd=ROOT, text=True,
                          capture_output=True, timeout=900)


async def last_release(run_dir: Path, model: str) -> Release:
    registry = create_model_registry(f"sqlite:///{run_dir / 'registry.db'}")
    try:
        return (await registry.list_releases(model))[-1]
    finally:
        await registry.close()


async def story(url: str, run_dir: Path, model: str, uri: str) -> dict[str, Any]:
    samples: list[Sample] = []
    probes: list[Sample] = []
    stop = asyncio.Event()
    load = asyncio.create_task(keep_loaded(url, model, samples, stop))
    prober = asyncio.create_task(probe(url, model, probes, stop))
    await asyncio.sleep(STEADY_S)
    added = await asyncio.to_thread(cli, run_dir, "models", "add", f"{model}@v2", uri)
    if added.returncode != 0:
        raise RuntimeError(added.stderr)
    released = await asyncio.to_thread(cli, run_dir, "release", f"{model}@v2")
    await asyncio.sleep(AFTER_S)
    stop.set()
    await asyncio.gather(load, prober)
    if released.returncode != 0:
        raise RuntimeError(released.stdout + released.stderr)
    return measure(samples, probes, await last_release(run_dir, model))


def _p(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of seconds, in ms."""
    return percentile(values, q * 100) * 1000


def measure(samples: list[Sample], probes: list[Sample], release: Release) -> dict[str, Any]:
    began = release.history[0][1]
    ended = release.history[-1][1]
    steady = [s.ttft_s for s in samples if s.started_at < began and s.ttft_s is not None]
    switch = [s.ttft_s for s in samples
              if began <= s.started_at <= ended and s.ttft_s is not None]
    v1_starts = [s.started_at for s in probes if s.version.endswith("@v1")]
    v2_starts = [s.started_at for s in probes if s.version.endswith("@v2")]
    ready_at = release.stats["ready_at"]
    return {
        "num_requests": len(samples), "num_failed": sum(not s.ok for s in samples + probes),
        "num_probes": len(probes),
        "steady_ttft_p50_ms": _p(steady, 0.5), "steady_ttft_p99_ms": _p(steady, 0.99),
        "switch_ttft_p99_ms": _p(switch, 0.99), "num_during_switch": len(switch),
        "switch_over_steady_p99": _p(switch, 0.99) / _p(steady, 0.99),
        "ready_to_flip_ms": release.stats["ready_to_flip_s"] * 1000,
        "ready_to_all_new_ms": max(0.0, max(v1_starts) - ready_at) * 1000,
        "last_v1_start_after_ready_ms": (max(v1_starts) - ready_at) * 1000,
        "first_v2_start_after_ready_ms": (min(v2_starts) - ready_at) * 1000,
        "release_s": ended - began,
        "history": [[state, round(at - began, 3)] for state, at in release.history],
    }


def one_round(real: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="strata-release-") as tmp:
        root = Path(tmp)
        if real:
            model, uri = "SmolLM2-135M-Instruct", "smollm2"
            args, replicas = ["--model-version", "v1"], 1
        else:
            model, uri = "sim-smollm2", f"sim:{SIM_PROFILE}"
            args = ["--simulate", str(SIM_PROFILE), "--served-model-name", model,
                    "--model-version", "v1"]
            replicas = 2
        proc, url, run_dir = start_cluster(root, args, replicas=replicas)
        try:
            return asyncio.run(story(url, run_dir, model, uri))
        finally:
            stop_cluster(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--real", action="store_true", help="the default model, not simulated")
    args = parser.parse_args()
    rounds = []
    for i in range(args.rounds):
        result = one_round(args.real)
        rounds.append(result)
        print(f"round {i + 1}: " + ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in result.items() if k != "history"), flush=True)
    keys = [k for k, v in rounds[0].items() if isinstance(v, (int, float))]
    medians = {k: statistics.median(r[k] for r in rounds) for k in keys}
    label = "real default model, 1 replica" if args.real else "SIMULATED (smollm2-cpu profile)"
    print(f"\nmedians of {args.rounds} rounds, {label}, load average {load_average()}:")
    for k, v in medians.items():
        print(f"  {k:26s} {v:10.2f}")
    verdicts = targets(rounds)
    for name, met in verdicts.items():
        print(f"  target {name}: {'met' if met else 'MISSED'}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "release_switch_real.json" if args.real else "release_switch.json"
    (RESULTS / name).write_text(json.dumps({"label": label, "rounds": rounds,
                                            "medians": medians, "targets": verdicts}, indent=2))


def targets(rounds: list[dict[str, Any]]) -> dict[str, bool]:
    """Each target, met in every round (the worst round decides)."""
    return {
        "switch TTFT p99 <= 2x steady": all(r["switch_over_steady_p99"] <= 2.0 for r in rounds),
        "ready -> flip < 1 s": all(r["ready_to_flip_ms"] < 1000.0 for r in rounds),
        "ready -> all new traffic <= 1 s": all(r["ready_to_all_new_ms"] <= 1000.0
                                               for r in rounds),
        "0 failed requests": all(r["num_failed"] == 0 for r in rounds),
    }


if __name__ == "__main__":
    main()
