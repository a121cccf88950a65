"""The live part of bench/autoscale.py: `strata up --simulate --autoscale` under a load step,
and a start from zero replicas. Real processes; streamed requests; the gateway's /metrics."""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from failover import start_cluster, stop_cluster
from gateway_overhead import BENCH

from strata.autoscale.capacity import CapacityModel
from strata.sim.profile import LatencyProfile

MODEL = "sim-autoscale"
# 4 running slots, 50 ms a decode step: a 20-token answer takes about 1 s, so one instance
# serves about 3.7 requests/s and the load stays light for the client and the gateway
PROFILE = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=2.0,
                         prefill_ms_per_token=0.1, decode_ms_base=50.0, decode_ms_per_seq=0.5)
SLOTS, START_S, SLO_S = 4, 5.0, 1.0
PER_INSTANCE_RPS = CapacityModel(PROFILE, SLOTS, 0.1).requests_per_s(10, 20)
PHASES = ((30.0, 0.6), (60.0, 2.4), (70.0, 0.6))  # (seconds, x one instance's capacity)


def cluster_args(root: Path, min_replicas: int) -> list[str]:
    PROFILE.save(root / "profile.json")
    return ["--simulate", str(root / "profile.json"), "--served-model-name", MODEL,
            "--max-num-seqs", str(SLOTS), "--sim-start-s", str(START_S), "--autoscale",
            "--min-replicas", str(min_replicas), "--max-replicas", "4",
            "--autoscale-profile", str(root / "profile.json"),
            "--autoscale-prompt-tokens", "10", "--autoscale-output-tokens", "20",
            "--ttft-slo-s", str(SLO_S), "--scale-down-dwell-s", "10",
            "--scale-down-after-up-s", "20"]


@dataclass
class Sent:
    at: float
    ttft_s: float | None = None
    ok: bool = False
    problem: str = ""


async def stream(client: httpx.AsyncClient, out: list[Sent]) -> None:
    sent = Sent(time.monotonic())
    out.append(sent)
    body = {"model": MODEL, "prompt": "the world of", "max_tokens": 20, "stream": True,
            "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and sent.ttft_s is None:
                    sent.ttft_s = time.monotonic() - sent.at
                if '"error"' in line:
                    sent.problem = line[:200]
                if line == "data: [DONE]":
                    sent.ok = resp.status_code == 200 and not sent.problem
            if resp.status_code != 200:
                sent.problem = f"HTTP {resp.status_code}"
    except httpx.HTTPError as exc:
        sent.problem = f"{type(exc).__name__}: {exc}"


async def watch(client: httpx.AsyncClient, until: float,
                samples: list[tuple[float, float, float]]) -> None:
    """(time, desired, ready) from the gateway's /metrics every 0.25 s."""
    while time.monotonic() < until:
        try:
            text = (await client.get("/metrics")).text
            found = [re.search(rf"^strata:autoscaler_{name}_replicas (\S+)$", text, re.M)
                     for name in ("desired", "ready")]
            if all(found):
                samples.append((time.monotonic(), float(found[0].group(1)),  # type: ignore
                                float(found[1].group(1))))  # type: ignore[union-attr]
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.25)


async def step_story(url: str) -> tuple[list[Sent], list[tuple[float, float, float]], float,
                                        float]:
    sent: list[Sent] = []
    samples: list[tuple[float, float, float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=400)) as client:
        started = time.monotonic()
        total = sum(s for s, _ in PHASES)
        watcher = asyncio.create_task(watch(client, started + total + 5, samples))
        tasks, at = [], started
        for seconds, load in PHASES:
            end = at + seconds
            while at < end:
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                tasks.append(asyncio.create_task(stream(client, sent)))
                at += 1.0 / (load * PER_INSTANCE_RPS)
        await asyncio.gather(*tasks)
        await watcher
    return sent, samples, started, started + PHASES[0][0]


def summarize_step(sent: list[Sent], samples: list[tuple[float, float, float]], started: float,
                   step_at: float) -> dict[str, Any]:
    ups = [t for t, desired, _ in samples if t >= step_at and desired > samples[0][1]]
    by_second: dict[int, list[float]] = {}
    for s in sent:
        by_second.setdefault(int(s.at - started), []).append(s.ttft_s or 1e9)
    p95 = {k: sorted(v)[int(0.95 * (len(v) - 1))] for k, v in sorted(by_second.items())}
    step_second = int(step_at - started)
    over = [k for k, v in p95.items() if k >= step_second and v > SLO_S]
    failures = [(round(s.at - started, 2), s.problem) for s in sent if not s.ok]
    return {"requests": len(sent), "failed": len(failures), "failures": failures[:10],
            "first_decision_s": round(ups[0] - step_at, 2) if ups else None,
            "ttft_back_under_slo_s": (max(over) + 1 - step_second) if over else 0,
            "max_desired": max(d for _, d, _ in samples),
            "final_desired": samples[-1][1], "ttft_p95_by_second": p95,
            "replicas": [(round(t - started, 2), d, r) for t, d, r in samples]}


async def zero_story(url: str) -> dict[str, Any]:
    """The first request wakes the fleet; the instance's real start time (the autoscaler's
    decision to the instance ready, both from /metrics) is measured beside its TTFT."""
    sent: list[Sent] = []
    samples: list[tuple[float, float, float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.sleep(3.0)  # idle: nothing runs
        watcher = asyncio.create_task(watch(client, time.monotonic() + 30, samples))
        await stream(client, sent)
        await asyncio.gather(*(stream(client, sent) for _ in range(10)))
        await watcher
    decided = next(t for t, d, _ in samples if d >= 1)
    ready = next(t for t, _, r in samples if r >= 1)
    return {"first_token_s": round(sent[0].ttft_s or -1, 2),
            "decision_after_first_request_s": round(decided - sent[0].at, 2),
            "instance_start_s": round(ready - decided, 2),
            "failed": sum(not s.ok for s in sent), "requests": len(sent)}


def plot(step: dict[str, Any], img: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    t, d, r = zip(*step["replicas"], strict=True)
    axes[0].step(t, d, where="post", label="desired")
    axes[0].step(t, r, where="post", label="ready")
    axes[0].set_ylabel("replicas")
    seconds = sorted(step["ttft_p95_by_second"])
    axes[1].plot(seconds, [min(step["ttft_p95_by_second"][k], 10.0) for k in seconds],
                 label="client TTFT p95 by send second (s)")
    axes[1].axhline(SLO_S, color="r", ls="--", lw=1, label="SLO")
    axes[1].set_ylabel("TTFT p95 (s)")
    axes[1].set_xlabel("seconds: 0.6x one instance, 2.4x from 30 s, 0.6x from 90 s; S = 5 s "
                       "(+ the process's own start)")
    for ax in axes:
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(img / "autoscale-live-step.png", dpi=110)


def live_results(img: Path) -> dict[str, Any]:
    (BENCH / "tmp").mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="autoscale-", dir=BENCH / "tmp"))
    proc, url, _ = start_cluster(root, cluster_args(root, 1), replicas=1)
    try:
        step = summarize_step(*asyncio.run(step_story(url)))
    finally:
        stop_cluster(proc)
    plot(step, img)
    root = Path(tempfile.mkdtemp(prefix="autoscale-zero-", dir=BENCH / "tmp"))
    proc, url, _ = start_cluster(root, cluster_args(root, 0), replicas=0)
    try:
        zero = asyncio.run(zero_story(url))
    finally:
        stop_cluster(proc)
    return {"step": step, "from_zero": zero}


__all__ = ["live_results"]
