"""Cache-aware routing against the other routers on a shared-prefix workload.

    .venv/bin/python bench/cache_aware.py --fleet sim --rounds 3
    .venv/bin/python bench/cache_aware.py --fleet real --rounds 1 --requests 60

Workload: `--tenants` (50) tenants, each with a system prompt of `--system-words` (1,000) words
(about as many tokens with both the simulated and the SmolLM2 tokenizer), Zipf popularity
(s = `--zipf`), a unique 30-word question per request, 16 output tokens; the same request
sequence for every router, sent `--concurrency` at a time (closed loop), streamed.

Fleets: `sim` is 8 simulated instances (`strata serve --simulate smollm2-cpu`, the real engine,
scheduler and prefix cache over the fitted latency profile); `real` is 2 real SmolLM2-135M
instances, one thread each. Each run starts its instances afresh (cold caches).

Routers: Strata's gateway with round_robin, power_of_two and cache_aware; sglang-router
(`cache_aware`) and vllm-router (`cache_aware`) from `--peers` (a venv with both:
`python3 -m venv /tmp/ca_routers && /tmp/ca_routers/bin/pip install sglang-router vllm-router`;
never committed). Rounds interleave the routers (A B C ... A B C ...); the table is the median.

Measured per run: prefix-cache hit rate (cached / prompt tokens, from each answer's usage)
against a single-cache oracle (one infinite prefix cache seeing the same requests in order:
the upper bound), the load spread (max / mean of each instance's time-averaged requests in
flight, sampled from GET /load, and of requests served), TTFT p50 / p99, non-200 answers (shed).
Numbers are provisional: the machine is shared (the load average is printed with them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from procs import Proc, spawn, stop_all, wait_http

from strata.bench.report import percentile
from strata.cluster.local import free_port
from strata.gateway.routing.prefix.prompt import Prompt, PromptHasher
from strata.sim.tokenizer import WORDS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / ".bench" / "results" / "cache_aware.json"
STRATA = ("round_robin", "power_of_two", "cache_aware")
RUST = ("sglang-cache_aware", "vllm-cache_aware")
MODEL = "m"


def workload(args: argparse.Namespace) -> list[tuple[int, list[dict[str, str]]]]:
    rng = random.Random(args.seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(args.system_words))
               for _ in range(args.tenants)]
    weights = [1 / (k + 1) ** args.zipf for k in range(args.tenants)]
    out = []
    for i in range(args.requests):
        tenant = rng.choices(range(args.tenants), weights)[0]
        question = f"question {i}: " + " ".join(rng.choice(WORDS) for _ in range(30))
        out.append((tenant, [{"role": "system", "content": systems[tenant]},
                             {"role": "user", "content": question}]))
    return out


def oracle_hit_rate(url: str, requests: list[tuple[int, list[dict[str, str]]]]) -> float:
    """One infinite prefix cache over the requests in order (the engine's hit rule: at least
    one prompt token is computed)."""
    spec = httpx.get(f"{url}/v1/strata/tokenizer", timeout=30).json()
    hasher = PromptHasher(spec)
    seen: set[bytes] = set()
    hit = total = 0
    for _, messages in requests:
        keys = hasher.keys(Prompt(messages=messages), 16, f"{MODEL}@v1")
        usable = keys.keys[: (keys.num_prompt_tokens - 1) // 16]
        num = next((i for i, key in enumerate(usable) if key not in seen), len(usable))
        hit, total = hit + num * 16, total + keys.num_prompt_tokens
        seen.update(keys.keys)
    return hit / total


def start_instances(args: argparse.Namespace, log_dir: Path) -> list[Proc]:
    procs = []
    for k in range(args.instances):
        port = free_port()
        model = ["--simulate", "smollm2-cpu"] if args.fleet == "sim" else \
            [args.model, "--threads", "1"]
        argv = [sys.executable, "-m", "strata.cli", "serve", *model, "--port", str(port),
                "--served-model-name", MODEL, "--model-version", "v1",
                "--kv-cache-gb", str(args.kv_cache_gb), "--log-level", "warning"]
        procs.append(spawn(f"instance{k}", argv, log_dir, f"http://127.0.0.1:{port}"))
    try:
        for proc in procs:
            wait_http(proc, "/ready", 600)
    except BaseException:
        stop_all(procs)
        raise
    return procs


def start_router(name: str, urls: list[str], args: argparse.Namespace, log_dir: Path) -> Proc:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if name in STRATA:
        argv = [sys.executable, "-m", "strata.cli", "gateway", "--port", str(port),
                "--instances", *urls, "--policy", name, "--log-level", "warning",
                "--max-in-flight", "1024"]
        proc = spawn(name, argv, log_dir, url)
        wait_http(proc, "/ready", 60)
        return proc
    kind, policy = name.split("-", 1)
    exe = Path(args.peers) / ("sglang-router" if kind == "sglang" else "vllm-router")
    if not exe.exists():
        raise RuntimeError(f"{exe} is missing (see the module docstring)")
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
              "--policy", policy, "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(free_port()), "--log-level"]
    argv = [str(exe), "launch", *common, "warn"] if kind == "sglang" else \
        [str(exe), *common, "warning"]
    proc = spawn(name, argv, log_dir, url)
    wait_http(proc, "/health", 60)
    return proc


async def one(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result: dict[str, Any] = {"status": 0, "ttft_s": None, "prompt": 0, "cached": 0}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        result["status"] = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if result["ttft_s"] is None:
                result["ttft_s"] = time.perf_counter() - start
            usage = json.loads(line[6:]).get("usage")
            if usage:
                result["prompt"] = usage["prompt_tokens"]
                result["cached"] = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0)
    return result


async def drive(url: str, requests: list[tuple[int, list[dict[str, str]]]],
                concurrency: int) -> list[dict[str, Any]]:
    queue = list(reversed(requests))
    results: list[dict[str, Any]] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            _, messages = queue.pop()
            try:
                results.append(await one(client, messages))
            except httpx.HTTPError as exc:
                results.append({"status": -1, "ttft_s": None, "error": repr(exc)})

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


class LoadSampler(threading.Thread):
    """Each instance's requests in flight (GET /load), sampled every `interval_s`."""

    def __init__(self, urls: list[str], interval_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.urls, self.interval_s = urls, interval_s
        self.sums = [0.0] * len(urls)
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self.stopped.wait(self.interval_s):
                for k, url in enumerate(self.urls):
                    try:
                        data = client.get(f"{url}/load").json()
                        self.sums[k] += data["num_running"] + data["num_waiting"]
                    except (httpx.HTTPError, ValueError, KeyError):
                        pass


def served(urls: list[str]) -> list[float]:
    counts = []
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        counts.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("strata:request_success_total{")))
    return counts


def spread(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return max(values) / mean if mean > 0 else 0.0


def run_one(name: str, args: argparse.Namespace, requests: list[Any], log_dir: Path,
            oracle: dict[str, float]) -> dict[str, Any]:
    instances = start_instances(args, log_dir)
    urls = [p.url for p in instances]
    router = None
    try:
        if "hit" not in oracle:
            oracle["hit"] = oracle_hit_rate(urls[0], requests)
        router = start_router(name, urls, args, log_dir)
        sampler = LoadSampler(urls)
        sampler.start()
        started = time.perf_counter()
        results = asyncio.run(drive(router.url, requests, args.concurrency))
        wall_s = time.perf_counter() - started
        sampler.stopped.set()
        sampler.join()
        counts = served(urls)
    finally:
        stop_all([*([router] if router else []), *instances])
    ok = [r for r in results if r["status"] == 200 and r["ttft_s"] is not None]
    ttfts = [r["ttft_s"] for r in ok]
    hit = sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok))
    return {"router": name, "hit_rate": hit, "oracle_hit_rate": oracle["hit"],
            "inflight_max_over_mean": spread(sampler.sums),
            "served_max_over_mean": spread(counts),
            "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
            "num_failed": len(results) - len(ok), "wall_s": wall_s,
            "load_average": os.getloadavg()[0]}


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"router": runs[0]["router"], "rounds": len(runs)}
    for key in runs[0]:
        if key != "router":
            row[key] = statistics.median(r[key] for r in runs)
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fleet", choices=("sim", "real"), default="sim")
    ap.add_argument("--routers", nargs="+", default=[*STRATA, *RUST])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=None, help="default: 600 sim, 80 real")
    ap.add_argument("--concurrency", type=int, default=None, help="default: 24 sim, 4 real")
    ap.add_argument("--tenants", type=int, default=50)
    ap.add_argument("--system-words", type=int, default=1000)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="per instance (default 0.45 sim: 1,300 blocks, a third of all tenants' "
                         "prompts; 0.6 real)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--peers", default="/tmp/ca_routers/bin")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    is_sim = args.fleet == "sim"
    args.instances = 8 if is_sim else 2
    args.requests = args.requests or (600 if is_sim else 80)
    args.concurrency = args.concurrency or (24 if is_sim else 4)
    args.kv_cache_gb = args.kv_cache_gb or (0.45 if is_sim else 0.6)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    requests = workload(args)
    log_dir = ROOT / ".bench" / "logs" / f"cache_aware_{args.fleet}"
    oracle: dict[str, float] = {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.routers}
    for round_no in range(args.rounds):
        for name in args.routers:
            row = run_one(name, args, requests, log_dir, oracle)
            runs[name].append(row)
            print(f"round {round_no + 1} {json.dumps(row)}", flush=True)
    table = [median_row(r) for r in runs.values()]
    print(f"\n{args.fleet} fleet, {args.instances} instances, {args.requests} requests, "
          f"concurrency {args.concurrency}, {args.tenants} tenants x {args.system_words} words, "
          f"zipf {args.zipf}; medians of {args.rounds} rounds; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| router | hit rate | oracle | in-flight max/mean | served max/mean | TTFT p50 ms "
          "| TTFT p99 ms | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['router']} | {row['hit_rate']:.3f} | {row['oracle_hit_rate']:.3f} | "
              f"{row['inflight_max_over_mean']:.2f} | {row['served_max_over_mean']:.2f} | "
              f"{row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} | {row['num_failed']:.0f} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    out = RESULTS.with_name(f"cache_aware_{args.fleet}.json")
    out.write_text(json.dumps({"args": vars(args), "runs": runs, "table": table}, indent=2))


if __name__ == "__main__":
    main()
