"""KV offload: from which history length does fetching KV from Redis beat recomputing it?

One engine (SmolLM2, bfloat16, the real TorchExecutor, chunked prefill of 512 tokens) and a real
Redis (started here). For each history length L, the next turn's prompt is the history plus 16
new tokens, and its time to first token (TTFT) is measured three ways:

    recompute  cold local prefix cache, nothing fetched: the whole prompt is prefilled
    fetch      cold local prefix cache, the history's KV blocks in Redis: the server's own fetch
               path (strata.server.kv_offload: hash, count, MGET) + import + the 16 new tokens
    local      the history's blocks in the local prefix cache (the sticky-routing best case)

TTFT runs from the start of the fetch (or the request's submission) to the first token, in
process (no HTTP). The export at the end of the turn is left out (it happens after the answer's
last token, never before the first). Medians of --repeats runs.

    .venv/bin/python bench/kv_offload.py [--lengths 128 256 ...] [--repeats 5] [--threads 2]

Writes .bench/results/kv_offload.json.
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

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from procs import start_redis  # noqa: E402

from strata.engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from strata.engine.engine import Engine  # noqa: E402
from strata.engine.request import Request, SamplingParams  # noqa: E402
from strata.model.executor import TorchExecutor  # noqa: E402
from strata.model.fetch import resolve_model  # noqa: E402
from strata.model.loader import load_model  # noqa: E402
from strata.server.kv_offload import KVOffload  # noqa: E402
from strata.server.metrics import ServerMetrics  # noqa: E402
from strata.state.kv_store import KVStore, KVStoreLimits, create_kv_store  # noqa: E402
from strata.types import RequestId  # noqa: E402

CACHE_DIR = Path("/tmp/strata-cache")
RESULTS = ROOT / ".bench" / "results" / "kv_offload.json"
NAME, VERSION, BLOCK_SIZE, NEW_TOKENS = "smollm2", "bench", 16, 16
MODES = ("recompute", "fetch", "local")


def build_engine(model: str | None, max_model_len: int) -> Engine:
    loaded = load_model(resolve_model(model, cache_dir=CACHE_DIR, progress=False),
                        dtype="bfloat16", cache_dir=CACHE_DIR)
    executor = TorchExecutor(loaded.config, loaded.weights, dtype="bfloat16", model_name=NAME,
                             model_version=VERSION)
    num_blocks = CacheConfig.blocks_for_gb(1.5, executor.kv_bytes_per_token(), BLOCK_SIZE)
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks,
                        namespace=f"{NAME}@{VERSION}")
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512,
                            max_model_len=max_model_len)
    return Engine(executor, cache, sched, loaded.tokenizer, vocab_size=loaded.config.vocab_size)


_ids = iter(range(1_000_000))


def request(prompt: list[int]) -> Request:
    return Request(RequestId(f"b{next(_ids)}"), list(prompt),
                   SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))


def first_token(engine: Engine, req: Request) -> list[Any]:
    engine.add_request(req)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


async def ttft_s(engine: Engine, prompt: list[int], offload: KVOffload | None) -> tuple[float,
                                                                                       float]:
    """(TTFT, of which the store fetch) of one request running alone."""
    req = request(prompt)
    started = time.perf_counter()
    if offload is not None:
        await offload.prepare([req])
        req.kv_export = False  # the export follows the answer's last token: not part of TTFT
    fetched = time.perf_counter()
    first_token(engine, req)
    done = time.perf_counter()
    return done - started, fetched - started


async def publish(engine: Engine, store: KVStore, history: list[int]) -> int:
    """Run the history as a turn and write its blocks to the store, as a server would."""
    req = request(history)
    req.kv_export = True
    blocks = first_token(engine, req)[-1].kv_blocks
    await store.put_many(blocks)
    return sum(len(p) for _, p in blocks)


async def measure(engine: Engine, store: KVStore, length: int, repeats: int,
                  rng: random.Random) -> dict[str, Any]:
    offload = KVOffload(store, engine, ServerMetrics(NAME).kv, NAME, min_fetch_tokens=0)
    history = [rng.randrange(1000, 40000) for _ in range(length)]
    prompt = history + [rng.randrange(1000, 40000) for _ in range(NEW_TOKENS)]
    num_bytes = await publish(engine, store, history)
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    fetch_only: list[float] = []
    for _ in range(repeats):
        runs["local"].append((await ttft_s(engine, prompt, None))[0])
        engine.reset_prefix_cache()
        runs["recompute"].append((await ttft_s(engine, prompt, None))[0])
        engine.reset_prefix_cache()
        total, store_s = await ttft_s(engine, prompt, offload)
        runs["fetch"].append(total)
        fetch_only.append(store_s)
    row = {f"{mode}_ms": statistics.median(v) * 1000 for mode, v in runs.items()}
    return {"length": length, **row, "store_ms": statistics.median(fetch_only) * 1000,
            "fetched_mb": num_bytes / 1e6, "runs_ms": {m: [x * 1000 for x in v]
                                                      for m, v in runs.items()}}


def crossover(rows: list[dict[str, Any]]) -> int | None:
    """The shortest history from which fetching beats recomputing at every longer one."""
    found = None
    for row in reversed(rows):
        if row["fetch_ms"] >= row["recompute_ms"]:
            break
        found = row["length"]
    return found


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'history':>8} {'recompute ms':>13} {'fetch ms':>9} {'(store ms)':>11} "
          f"{'local ms':>9} {'KV MB':>7} {'fetch speedup':>14}")
    for r in rows:
        print(f"{r['length']:>8} {r['recompute_ms']:>13.1f} {r['fetch_ms']:>9.1f} "
              f"{r['store_ms']:>11.1f} {r['local_ms']:>9.1f} {r['fetched_mb']:>7.1f} "
              f"{r['recompute_ms'] / r['fetch_ms']:>13.2f}x")


async def run(args: argparse.Namespace, redis_url: str) -> list[dict[str, Any]]:
    engine = build_engine(args.model, max(args.lengths) + NEW_TOKENS + 64)
    store = create_kv_store(redis_url, limits=KVStoreLimits(max_put_bytes=1 << 30))
    rng = random.Random(args.seed)
    try:
        await measure(engine, store, 256, 2, rng)  # warm-up: first runs of a shape are slow
        rows = []
        for length in args.lengths:
            rows.append(await measure(engine, store, length, args.repeats, rng))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs_ms"}), flush=True)
        return rows
    finally:
        await store.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: smollm2")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kv-bench-") as tmp:
        redis = start_redis(Path(tmp))
        try:
            rows = asyncio.run(run(args, redis.url))
        finally:
            redis.stop()
    print_table(rows)
    print(f"fetching beats recomputing from {crossover(rows)} tokens of history "
          f"(load average before: {load[0]:.2f}, after: {os.getloadavg()[0]:.2f})")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "load_before": load,
                                   "load_after": os.getloadavg(), "rows": rows}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
