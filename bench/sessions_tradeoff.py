"""The session trade-off (issue 5): where should a conversation's history live?

Two real `strata serve` instances (session store: a Redis this script starts) behind a router, a
multi-turn workload of S sessions x T turns (growing history, greedy, fixed output length with
ignore_eos), all sessions at once, each session's turns one after the other. Modes:

    recompute    strata gateway --policy round_robin --session-routing external, instances with
                 --no-prefix-cache: the history is loaded from the store and recomputed each turn
    round_robin  the same with the prefix cache on: recomputed unless that instance has it cached
    external_kv  round_robin with KV offload (--kv-offload, KV store in database 1 of the same
                 Redis, emptied before each run): each turn
                 publishes its KV blocks; the next turn's instance fetches the history's blocks
                 it lacks instead of recomputing them
    sticky       strata gateway --session-routing sticky (bounded-load consistent hash, pins
                 in Redis)
    hybrid       strata gateway --session-routing hybrid (sticky; a moved session rebuilds from
                 the store; with no failure it routes like sticky)
    sglang-cache_aware / vllm-consistent_hash
                 the Rust routers; the client resends the whole history (they keep no sessions);
                 vllm-router hashes the X-User-ID header (X-Session-Id would turn on Strata
                 sessions)

From which history length fetching KV beats recomputing it on this CPU: bench/kv_offload.py.

Per mode: TTFT p50/p99 (streamed, first content chunk), TTFT p50 per turn number, turns/s,
output tokens/s and the prefix-hit rate (sum of usage.prompt_tokens_details.cached_tokens over
sum of prompt_tokens). Each mode gets a fresh pair of instances (cold prefix caches).

    .venv/bin/python bench/sessions_tradeoff.py            # S=8, T=6, 32 output tokens
    .venv/bin/python bench/sessions_tradeoff.py --quick    # smoke: S=4, T=3, 8 tokens

Writes .bench/results/sessions_tradeoff[_quick].json and docs/img/sessions_tradeoff.png.
Every mode runs --repeats times (default 3), interleaved; the table shows medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from procs import Proc, spawn, start_redis, stop_all, wait_http

from strata.bench.report import percentile
from strata.cluster.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".bench" / "peers"
RESULTS = ROOT / ".bench" / "results" / "sessions_tradeoff.json"
PLOT = ROOT / "docs" / "img" / "sessions_tradeoff.png"
STRATA_MODES = ("recompute", "round_robin", "external_kv", "sticky", "hybrid")
RUST_MODES = ("sglang-cache_aware", "vllm-consistent_hash")
MODES = STRATA_MODES + RUST_MODES
WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "number night point home water room mother area money story fact month lot").split()


def start_instances(args: argparse.Namespace, redis_url: str, log_dir: Path,
                    extra: list[str]) -> list[Proc]:
    procs = []
    for k in range(2):
        port = free_port()
        argv = [sys.executable, "-m", "strata.cli", "serve", args.model, "--port", str(port),
                "--threads", str(args.threads), "--session-store", redis_url,
                "--served-model-name", "m", "--log-level", "warning", *extra]
        procs.append(spawn(f"instance{k}", argv, log_dir, f"http://127.0.0.1:{port}"))
    try:
        for proc in procs:
            wait_http(proc, "/v1/models", 300)
    except BaseException:
        stop_all(procs)  # the other instance too: run_mode only stops what this returned
        raise
    return procs


def start_router(mode: str, urls: list[str], redis_url: str, log_dir: Path) -> Proc:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if mode in STRATA_MODES:
        routing = mode if mode in ("sticky", "hybrid") else "external"
        argv = [sys.executable, "-m", "strata.cli", "gateway", "--port", str(port),
                "--instances", *urls, "--policy", "round_robin", "--session-routing", routing,
                "--session-store", redis_url, "--log-level", "warning"]
        proc = spawn(mode, argv, log_dir, url)
        wait_http(proc, "/ready", 60)
        return proc
    kind, policy = mode.split("-", 1)
    exe = PEERS / ("sglang/bin/sglang-router" if kind == "sglang" else "vllmr/bin/vllm-router")
    if not exe.exists():
        raise RuntimeError(f"{exe} is missing: python3 -m venv {exe.parent.parent} && "
                           f"{exe.parent}/pip install {kind}-router")
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
              "--policy", policy, "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(free_port()), "--log-level"]
    argv = [str(exe), "launch", *common, "warn"] if kind == "sglang" else [str(exe), *common,
                                                                            "warning"]
    proc = spawn(mode, argv, log_dir, url)
    wait_http(proc, "/health", 60)
    return proc


@dataclass
class Turn:
    session: int
    turn: int
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


@dataclass
class Conversation:
    """One session's client: only the new message (Strata sessions) or the whole history."""

    index: int
    user_turns: list[str]
    explicit: bool
    session_id: str  # unique per run: the store outlives runs
    history: list[dict[str, str]] = field(default_factory=list)


async def send_turn(client: httpx.AsyncClient, url: str, conv: Conversation, n: int,
                    mode: str, args: argparse.Namespace) -> Turn:
    message = {"role": "user", "content": conv.user_turns[n]}
    messages = [*conv.history, message] if conv.explicit else [message]
    sid = conv.session_id
    headers = {"X-User-ID": sid} if conv.explicit else {"X-Session-Id": sid}
    body = {"model": "m", "messages": messages, "max_tokens": args.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    turn, started = Turn(conv.index, n), time.perf_counter()
    text: list[str] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers=headers) as response:
            if response.status_code != 200:
                turn.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
                return turn
            async for line in response.aiter_lines():
                read_event(line, turn, text, started)
    except httpx.HTTPError as exc:
        turn.error = repr(exc)
    conv.history += [message, {"role": "assistant", "content": "".join(text)}]
    return turn


def read_event(line: str, turn: Turn, text: list[str], started: float) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    event = json.loads(line[6:])
    for choice in event.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content")
        if piece:
            text.append(piece)
            if turn.ttft_s is None:
                turn.ttft_s = time.perf_counter() - started
    if usage := event.get("usage"):
        turn.prompt_tokens = usage.get("prompt_tokens", 0)
        turn.output_tokens = usage.get("completion_tokens", 0)
        turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def words(rng: random.Random, num: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num))


async def run_workload(url: str, mode: str, args: argparse.Namespace) -> tuple[list[Turn], float]:
    rng, run_id = random.Random(args.seed), uuid.uuid4().hex[:8]
    convs = [Conversation(s, [words(rng, args.first_words if n == 0 else args.words)
                              for n in range(args.turns)], explicit=mode in RUST_MODES,
                          session_id=f"{mode}-{run_id}-{s}")
             for s in range(args.sessions)]
    limits = httpx.Limits(max_connections=args.sessions * 2)
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits) as client:
        async def one(conv: Conversation) -> list[Turn]:
            return [await send_turn(client, url, conv, n, mode, args) for n in range(args.turns)]

        started = time.perf_counter()
        done = await asyncio.wait_for(asyncio.gather(*(one(c) for c in convs)),
                                      timeout=args.timeout_s)
        return [t for turns in done for t in turns], time.perf_counter() - started


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (strata.bench.report's), None for no values (null in the JSON)."""
    return percentile(values, q) if values else None


def summarize(turns: list[Turn], wall_s: float, num_turns: int) -> dict[str, Any]:
    ok = [t for t in turns if t.error is None and t.ttft_s is not None]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    prompt = sum(t.prompt_tokens for t in ok)
    by_turn = [[t.ttft_s for t in ok if t.turn == n and t.ttft_s is not None]
               for n in range(num_turns)]
    return {"num_ok": len(ok), "num_failed": len(turns) - len(ok),
            "errors": sorted({t.error for t in turns if t.error})[:5],
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "turns_per_s": len(ok) / wall_s, "output_tokens_per_s":
                sum(t.output_tokens for t in ok) / wall_s,
            "prefix_hit_rate": sum(t.cached_tokens for t in ok) / prompt if prompt else None,
            "mean_prompt_tokens": prompt / len(ok) if ok else None, "wall_s": wall_s,
            "ttft_p50_by_turn_s": [statistics.median(v) if v else None for v in by_turn]}


def kv_store_url(redis_url: str) -> str:
    """The KV blocks live in database 1 of the same Redis, emptied before every run: blocks a
    previous repeat published (the same texts: one seed) must not turn this run's first turns
    into hits."""
    import redis

    url = redis_url.rsplit("/", 1)[0] + "/1"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url


def instance_flags(mode: str, redis_url: str) -> list[str]:
    if mode == "recompute":
        return ["--no-prefix-cache"]
    if mode == "external_kv":
        return ["--kv-store", kv_store_url(redis_url), "--kv-offload",
                "--kv-min-fetch-tokens", "64"]
    return []


def run_mode(mode: str, args: argparse.Namespace, redis_url: str, log_dir: Path) -> dict:
    procs = start_instances(args, redis_url, log_dir, instance_flags(mode, redis_url))
    try:
        router = start_router(mode, [p.url for p in procs], redis_url, log_dir)
        procs.append(router)
        turns, wall_s = asyncio.run(run_workload(router.url, mode, args))
        return summarize(turns, wall_s, args.turns)
    finally:
        stop_all(procs)


def plot(results: dict[str, Any], turns: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, row in results.items():
        if "ttft_p50_by_turn_s" in row:
            ys = [v * 1000 if v else float("nan") for v in row["ttft_p50_by_turn_s"]]
            ax.plot(range(1, turns + 1), ys,
                    marker="o", label=mode)
    ax.set(xlabel="turn number", ylabel="TTFT p50 (ms)", title=title)
    ax.set_xticks(range(1, turns + 1))
    ax.grid(alpha=0.3)
    ax.legend()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-words", type=int, default=400,
                   help="words of each session's first message (a pasted document)")
    p.add_argument("--words", type=int, default=20, help="words of every later user message")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads per instance")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of every mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--quick", action="store_true", help="smoke run: S=4, T=3, 8 tokens")
    p.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the plot from a "
                   "results file this script wrote")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.output_len, args.first_words = 4, 3, 8, 100
        args.repeats = 1
    return args


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats (and the spread of TTFT p50); a failed run is kept as an error."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[-1]
    out: dict[str, Any] = {"repeats": len(good), "errors": [r["error"] for r in runs
                                                           if "error" in r]}
    for key, value in good[0].items():
        if isinstance(value, (int, float)):
            values = [r[key] for r in good if r[key] is not None]
            out[key] = statistics.median(values) if values else None
    out["ttft_p50_spread_s"] = [min(r["ttft_p50_s"] for r in good),
                                max(r["ttft_p50_s"] for r in good)]
    out["ttft_p50_by_turn_s"] = [statistics.median(v) if (v := [r["ttft_p50_by_turn_s"][n]
                                 for r in good if r["ttft_p50_by_turn_s"][n] is not None])
                                 else None for n in range(len(good[0]["ttft_p50_by_turn_s"]))]
    return out


def run_all(args: argparse.Namespace, log_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every mode once per repeat, interleaved (A B C A B C): drift hits every mode alike."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    redis = start_redis(log_dir)
    try:
        for repeat in range(args.repeats):
            for mode in args.modes:
                print(f"== {mode} (repeat {repeat + 1}/{args.repeats})", flush=True)
                try:
                    runs[mode].append(run_mode(mode, args, redis.url, log_dir))
                except Exception as exc:  # a peer that cannot run is recorded, not fatal
                    runs[mode].append({"error": f"{type(exc).__name__}: {exc}"[:2000]})
                print(json.dumps(runs[mode][-1], default=str), flush=True)
    finally:
        redis.stop()
    return runs


def title_of(report: dict[str, Any]) -> str:
    """The plot title; `busy` when the 1-minute load average at the start was >= 1.0 (the run's
    own processes raise it afterwards)."""
    args, load = report["args"], report["load_before"][0]
    state = "busy machine" if load >= 1.0 else "quiet machine"
    return f"S={args['sessions']} x T={args['turns']}, {args['model']}, {state} (load {load:.1f})"


def stop_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"signal {signum}")  # so that every `finally` stops its processes


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    if args.replot is not None:
        report = json.loads(args.replot.read_text())
        plot(report["results"], report["args"]["turns"], title_of(report))
        return
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="sessions-bench-") as tmp:
        runs = run_all(args, Path(tmp))
    results = {mode: aggregate(r) for mode, r in runs.items()}
    load_after = os.getloadavg()
    report = {"args": vars(args), "load_before": load, "load_after": load_after,
              "cpus": os.cpu_count(), "results": results, "runs": runs}
    path = RESULTS.with_name(RESULTS.stem + ("_quick" if args.quick else "") + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    plot(results, args.turns, title_of(report))
    print(f"wrote {path} and {PLOT}")


if __name__ == "__main__":
    main()
