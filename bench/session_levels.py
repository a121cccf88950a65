"""Session history levels (issue 33): the price of each and the long form of their checks.

price   one `strata serve --simulate` instance (the fitted SmolLM2 CPU profile) per level and
        store, a Redis this script starts (append-only file, fsync always; `--replicated`: a
        replica too, the instance with --session-redis-replicas 1: WAIT). S sessions x T turns,
        all sessions at once, each session's turns one after the other, streamed. Per run:
        TTFT, turn latency (to [DONE]) and the store's share of it (last token to [DONE]: the
        turn is stored there at `strong`, queued at `session`/`eventual`), p50/p99.
checks  tests/harness/session_history.py for longer, with more writers, several Redis
        kills per level and as many partitions of one instance from Redis (a loopback proxy
        that resets its connections; CI form: tests/state/test_session_levels_checked.py); then
        a writing instance SIGKILLed at session and eventual (tests/harness/session_crash.py):
        the turns its queue lost and how long before the kill they were acknowledged.

    .venv/bin/python bench/session_levels.py price --replicated
    .venv/bin/python bench/session_levels.py checks --kills 3

Writes .bench/results/session_levels_{price,checks}.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from gateway_overhead import SIM_MODEL, SIM_PROFILE, WORDS, start_instance
from harness import session_crash
from harness import session_history as jepsen
from harness.redis_server import RedisServer
from harness.tcp_proxy import ChaosProxy
from procs import wait_http

from strata.bench.report import percentile
from strata.state.redis_db import find_redis_server
from strata.state.sessions import SessionStore, create_session_store

RESULTS = Path(__file__).resolve().parent.parent / ".bench" / "results"
LEVELS = ("strong", "session", "eventual")
MAX_PENDING = 64  # the checks' write-behind queue: what eventual may miss elsewhere


@dataclass
class Turn:
    ttft_s: float | None = None
    last_token_s: float | None = None
    turn_s: float | None = None
    error: str | None = None


async def send_turn(client: httpx.AsyncClient, url: str, session_id: str, text: str,
                    output_len: int) -> Turn:
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": output_len, "ignore_eos": True, "stream": True}
    turn, started = Turn(), time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers={"X-Session-Id": session_id}) as response:
        if response.status_code != 200:
            turn.error = f"{response.status_code}: {(await response.aread())[:120]!r}"
            return turn
        async for line in response.aiter_lines():
            now = time.perf_counter() - started
            if line == "data: [DONE]":
                turn.turn_s = now
            elif line.startswith("data: ") and '"content"' in line:
                turn.ttft_s = turn.ttft_s if turn.ttft_s is not None else now
                turn.last_token_s = now
            elif line.startswith("data: ") and '"error"' in line:
                turn.error = line[6:200]
    return turn


async def workload(url: str, args: argparse.Namespace, tag: str) -> list[Turn]:
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=60.0) as client:
        async def one(s: int) -> list[Turn]:
            texts = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(args.turns)]
            return [await send_turn(client, url, f"{tag}-{s}", t, args.output_len)
                    for t in texts]

        done = await asyncio.gather(*(one(s) for s in range(args.sessions)))
    return [t for turns in done for t in turns]


def summarize(turns: list[Turn]) -> dict[str, Any]:
    ok = [t for t in turns if t.error is None and t.turn_s is not None]

    def ms(values: list[float], q: float) -> float | None:
        return round(percentile(values, q) * 1000, 2) if values else None

    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    total = [t.turn_s for t in ok if t.turn_s is not None]
    store = [t.turn_s - t.last_token_s for t in ok
             if t.turn_s is not None and t.last_token_s is not None]
    return {"num_ok": len(ok), "num_failed": len(turns) - len(ok),
            "errors": sorted({t.error for t in turns if t.error})[:3],
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
            "turn_p50_ms": ms(total, 50), "turn_p99_ms": ms(total, 99),
            "store_p50_ms": ms(store, 50), "store_p99_ms": ms(store, 99)}


def price(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    binary = find_redis_server()
    assert binary is not None, "redis-server not found"
    primary = RedisServer(root / "primary", binary,
                          extra_args=["--appendonly", "yes", "--appendfsync", "always"])
    primary.start()
    replica = None
    if args.replicated:
        replica = RedisServer(root / "replica", binary,
                              extra_args=["--replicaof", "127.0.0.1", str(primary.port)])
        replica.start()
    stores = [("single", ())] + ([("replicated", ("--session-redis-replicas", "1"))]
                                 if replica else [])
    results: dict[str, Any] = {}
    try:
        for rnd in range(args.repeats):
            for store, flags in stores:
                for level in LEVELS:
                    name = f"{store}/{level}"
                    proc = start_instance(f"sim-{level}", root, simulate=SIM_PROFILE,
                                          model_name=SIM_MODEL, extra=(
                                              "--session-store", primary.url,
                                              "--session-consistency", level, *flags))
                    try:
                        wait_http(proc, "/v1/models", 60)
                        turns = asyncio.run(workload(proc.url, args, f"{name}-{rnd}"))
                    finally:
                        proc.stop()
                    results.setdefault(name, []).append(summarize(turns))
                    print(name, results[name][-1], flush=True)
    finally:
        for server in (replica, primary):
            if server is not None:
                server.stop()
    return results


async def checks_of(level: str, server: RedisServer, args: argparse.Namespace) -> dict[str, Any]:
    workload = jepsen.Workload(num_sessions=12, num_writers=24, seed=args.seed,
                               is_pinned=level != "strong", cross_reads=level == "eventual")
    proxy = ChaosProxy(server.port).start()  # instance 0 reaches the store through it
    urls = [f"redis://127.0.0.1:{proxy.port}/0", server.url, server.url]
    stores: list[SessionStore] = [create_session_store(url, consistency=level,
                                                       max_pending=MAX_PENDING)
                                  for url in urls]
    history, kills = jepsen.History(), []
    partitions: list[jepsen.Fault] = []
    stop = asyncio.Event()
    writers = asyncio.ensure_future(jepsen.run_writers(stores, history, workload, stop))
    for _ in range(args.kills):  # each round: a Redis kill, then instance 0 cut from Redis
        await asyncio.sleep(args.between_s)
        kills.append(await jepsen.kill_redis(server, history))
        await asyncio.sleep(args.between_s)
        partitions.append(await jepsen.partition_store(proxy, history, 0, len(stores),
                                                       min_cut_s=1.0))
    await asyncio.sleep(args.between_s)
    stop.set()
    await writers
    for store in stores:
        await store.close()
    proxy.stop()
    reader = create_session_store(server.url)
    final = await jepsen.final_histories(reader, [f"s{i}" for i in range(12)])
    await reader.close()
    lost = len(jepsen.lost_turns(history, final))
    violations = len(jepsen.read_your_writes_violations(history))
    stale = jepsen.staleness(history) if level == "eventual" else None
    holds = lost == 0 and all(k.is_applied for k in [*kills, *partitions]) and (
        stale.max_missed_turns <= MAX_PENDING if stale else violations == 0)
    return {"holds": holds, "acknowledged": len(history.acked()), "lost": lost,
            "read_your_writes_violations": violations,
            "staleness": asdict(stale) if stale else None,
            "kills": [asdict(k) | {"is_applied": k.is_applied} for k in kills],
            "partitions": [asdict(p) | {"is_applied": p.is_applied} for p in partitions]}


def checks(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    binary = find_redis_server()
    assert binary is not None, "redis-server not found"
    results = {}
    for level in LEVELS:
        server = RedisServer(root / level, binary,
                             extra_args=["--appendonly", "yes", "--appendfsync", "always"])
        server.start()
        try:
            results[level] = asyncio.run(checks_of(level, server, args))
        finally:
            server.stop()
        print(level, results[level], flush=True)
    results["instance_crash"] = crashes(binary, root, args)
    return results


def crashes(binary: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The write-behind levels' loss window: a writing instance SIGKILLed (session_crash)."""
    server = RedisServer(root / "crash", binary,
                         extra_args=["--appendonly", "yes", "--appendfsync", "always"])
    server.start()
    results: dict[str, Any] = {}
    try:
        for level in ("session", "eventual"):
            for _ in range(args.kills):
                _flushdb(server.url)
                crash = session_crash.crash(server.url, level, args.bound_ms)
                results.setdefault(level, []).append(asdict(crash))
                print(f"crash {level}: {crash}", flush=True)
    finally:
        server.stop()
    return results


def _flushdb(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("price", "checks"))
    p.add_argument("--replicated", action="store_true")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--between-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--bound-ms", type=float, default=200.0, help="the crashes' flush bound")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="session-levels-") as tmp:
        report = price(args, Path(tmp)) if args.what == "price" else checks(args, Path(tmp))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"session_levels_{args.what}.json"
    out.write_text(json.dumps({"argv": sys.argv, "results": report}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
