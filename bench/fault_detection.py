"""How soon Strata notices two faults whose tests assert only the cause (docs/reliability.md):

    rank_death   `strata serve --tensor-parallel-size 2` (the tiny nine-head model), a stream of
                 200 tokens, rank 1 SIGKILLed after the first event: seconds from the kill to
                 the stream's [DONE] (docs promise 2 s; the test allows 10)
    feed_drop    a simulated instance followed by the gateway's prefix feed (FeedConfig's
                 defaults), stopped: seconds until its entries are gone from the index (README:
                 within a second; the test allows 10)

Each is repeated `--repeat` times; prints and writes (.bench/results/fault_detection.json)
every run, the median and the spread, with the load average.

    .venv/bin/python bench/fault_detection.py [--repeat 5] [--only rank_death|feed_drop]
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
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
for sub in ("tests", "tests/gateway", "tests/server"):
    sys.path.insert(0, str(ROOT / sub))

from gateway.test_cache_aware_live import MODEL, chat_body, start_instance  # noqa: E402
from live_fleet import free_socket  # noqa: E402
from model.parallel.parallel_helpers import make_nine_head_model, rank_processes  # noqa: E402
from serve_process import start_serve  # noqa: E402

from strata.gateway.routing.instances import InstanceSet, InstanceView  # noqa: E402
from strata.gateway.routing.prefix.feed import PrefixRouting  # noqa: E402
from strata.gateway.routing.prefix.index import PrefixIndex  # noqa: E402
from strata.sim.tokenizer import WORDS  # noqa: E402


def rank_death(root: Path) -> float:
    model = make_nine_head_model(root / "tiny-nine")
    server = start_serve([str(model), "--tensor-parallel-size", "2", "--dtype", "float32",
                          "--kv-cache-gb", "0.01", "--log-level", "warning"],
                         cache_dir=root / "cache", timeout_s=300)
    try:
        (rank_1,) = rank_processes(server.proc.pid)
        body = {"model": "tiny-nine", "prompt": "once upon a time", "max_tokens": 200,
                "temperature": 0, "ignore_eos": True, "stream": True}
        killed_at = 0.0
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and not killed_at:
                    os.kill(rank_1, signal.SIGKILL)
                    killed_at = time.monotonic()
                if line == "data: [DONE]":
                    return time.monotonic() - killed_at
        raise AssertionError("the stream ended without [DONE]")
    finally:
        server.stop()


def feed_drop(root: Path) -> float:
    sock = free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop = start_instance(sock)
    index = PrefixIndex()
    system = " ".join(random.Random(1).choice(WORDS) for _ in range(200))

    async def measure() -> float:
        async with httpx.AsyncClient() as client:
            routing = PrefixRouting(index, InstanceSet([InstanceView("i1", url, MODEL)]), client)
            feed = asyncio.create_task(routing.run())
            while not ("i1" in routing.identities and routing.hashers):
                await asyncio.sleep(0.01)
            body = chat_body(system, "hello there")
            keys = routing.keys(json.loads(body), None, [InstanceView("i1", url, MODEL)])
            assert keys is not None
            keyset = keys.for_instance("i1")
            assert keyset is not None
            await client.post(f"{url}/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"})
            while index.match("i1", keyset.keys) < len(keyset.keys):
                await asyncio.sleep(0.01)
            stopped_at = time.monotonic()
            await asyncio.to_thread(stop)
            while index.match("i1", keyset.keys) > 0:
                await asyncio.sleep(0.005)
            took = time.monotonic() - stopped_at
            feed.cancel()
            await asyncio.gather(feed, return_exceptions=True)
            return took

    return asyncio.run(measure())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", choices=("rank_death", "feed_drop"), default=None)
    args = parser.parse_args()
    results = {}
    for name, fn in (("rank_death", rank_death), ("feed_drop", feed_drop)):
        if args.only not in (None, name):
            continue
        runs = []
        for _ in range(args.repeat):
            runs.append(round(fn(Path(tempfile.mkdtemp(prefix=f"strata-{name}-"))), 3))
            print(f"{name}: {runs[-1]} s", flush=True)
        results[name] = {"runs_s": runs, "median_s": statistics.median(runs),
                         "min_s": min(runs), "max_s": max(runs),
                         "load_average": os.getloadavg()[0]}
        print(f"{name}: median {statistics.median(runs):.3f} s, min {min(runs):.3f}, max "
              f"{max(runs):.3f} over {len(runs)} runs (load average {os.getloadavg()[0]:.1f})")
    out = ROOT / ".bench" / "results" / "fault_detection.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
