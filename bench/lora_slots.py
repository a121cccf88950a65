"""LoRA slot pressure (issue 26): 16 adapters over 4 slots against all 16 resident, TTFT p99.

The anchor: SGLang with 16 adapters over 8 slots went from a TTFT p50 of 40 ms to 6,278 ms
(sglang #13349), slot thrash. Here one engine (the default model, bf16) behind an AsyncEngine
and the server's LoraTable (strata/server/loras.py, as `strata serve` runs them), a closed loop
of C requests in flight, each on one of 16 random rank-8 adapters (uniform, fixed seed), and
three configurations run one after the other on the same prompts:

    resident   all 16 adapters resident, no limit of adapters per step (the baseline)
    step-4     all resident, `--max-loras 4`: at most 4 distinct adapters per step, the
               scheduler defers the rest (with aging, so none starves)
    cpu-4      `--max-cpu-loras 4 --max-loras 4`: 4 resident, a miss evicts the least recently
               used adapter no request holds and loads its own from disk (read, digest, checks)

Reported per configuration: TTFT p50/p99 (the request's arrival, including any wait for its
adapter, to its first token), output tokens/s, loads and evictions, and the p99 ratio to
`resident`. Issue target: p99 <= 3x.

Usage (JSON on stdout):
    .venv/bin/python bench/lora_slots.py [--requests 96] [--concurrency 8] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora import write_adapter  # noqa: E402
from strata_offline import build_engine, load, make_request  # noqa: E402
from workload import random_prompts  # noqa: E402

from strata.bench.report import percentile  # noqa: E402
from strata.model.loader import LoadedModel  # noqa: E402
from strata.model.lora import load_adapter  # noqa: E402
from strata.server.async_engine import AsyncEngine  # noqa: E402
from strata.server.config import ServerConfig  # noqa: E402
from strata.server.loras import LoraTable  # noqa: E402
from strata.server.metrics import ServerMetrics  # noqa: E402

NUM_ADAPTERS, SLOTS = 16, 4
CONFIGS = {"resident": (None, None), "step-4": (SLOTS, None), "cpu-4": (SLOTS, SLOTS)}


def run_config(loaded: LoadedModel, paths: dict[str, str], name: str,
               args: argparse.Namespace) -> dict[str, Any]:
    max_loras, max_cpu_loras = CONFIGS[name]
    engine = AsyncEngine(build_engine(loaded, prefix_cache=False, max_loras=max_loras),
                         max_model_len=2048)
    config = ServerConfig(served_model_name="bench", max_cpu_loras=max_cpu_loras,
                          lora_paths=dict(paths))
    metrics = ServerMetrics("bench")

    def loader(adapter: str, path: str) -> Any:
        return load_adapter(adapter, path, loaded.config, dtype=torch.bfloat16)

    table = LoraTable(engine, config, loader, metrics.lora)
    rng = random.Random(args.seed)
    order = [rng.choice(sorted(paths)) for _ in range(args.requests)]
    prompts = random_prompts(args.requests, args.prompt_len, loaded.config.vocab_size, seed=3)
    ttfts: list[float] = []

    async def one(i: int) -> int:
        adapter = order[i]
        t0 = time.perf_counter()
        await table.acquire(adapter)
        try:
            request = make_request(prompts[i], args.output_len)
            request.lora_name, request.lora_digest = adapter, config.loras[adapter]
            n = 0
            async for out in engine.generate(request):
                if n == 0 and out.new_token_ids:
                    ttfts.append(time.perf_counter() - t0)
                n += len(out.new_token_ids)
            return n
        finally:
            table.release(adapter)

    async def go() -> tuple[int, float]:
        engine.start()
        for adapter in sorted(paths)[: max_cpu_loras or NUM_ADAPTERS]:  # warm the resident
            await table.acquire(adapter)
            table.release(adapter)
        queue = list(range(args.requests))
        total = 0
        t0 = time.perf_counter()

        async def worker() -> None:
            nonlocal total
            while queue:
                n = await one(queue.pop(0))  # awaited first: `total +=` would read it early
                total += n
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        seconds = time.perf_counter() - t0
        await engine.shutdown(10.0)
        return total, seconds

    total, seconds = asyncio.run(go())
    registry = metrics.registry

    def counter(metric: str) -> float | None:
        return registry.get_sample_value(metric, {"model_name": "bench"})
    return {"max_loras": max_loras, "max_cpu_loras": max_cpu_loras,
            "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1),
            "ttft_p99_ms": round(percentile(ttfts, 99) * 1000, 1),
            "output_tokens_per_s": round(total / seconds, 1),
            "loads": counter("strata:lora_loads_total"),
            "evictions": counter("strata:lora_evictions_total")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=26)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(args.model)
    with tempfile.TemporaryDirectory(prefix="strata-lora-slots-") as tmp:
        paths = {f"s{k}": str(write_adapter(Path(tmp) / f"s{k}", loaded.config,
                                            str(loaded.source), seed=300 + k))
                 for k in range(NUM_ADAPTERS)}
        warm = argparse.Namespace(**{**vars(args), "requests": args.concurrency})
        run_config(loaded, paths, "resident", warm)  # the process's first steps are slower
        results = {}
        for name in CONFIGS:
            results[name] = run_config(loaded, paths, name, args)
            print(name, results[name], file=sys.stderr, flush=True)
    base = results["resident"]["ttft_p99_ms"]
    for name in CONFIGS:
        results[name]["p99_ratio"] = round(results[name]["ttft_p99_ms"] / base, 2)
    print(json.dumps({"model": Path(str(loaded.source)).name, "adapters": NUM_ADAPTERS,
                      "slots": SLOTS, "requests": args.requests,
                      "concurrency": args.concurrency, "prompt_len": args.prompt_len,
                      "output_len": args.output_len, "configs": results,
                      "target_met": all(r["p99_ratio"] <= 3.0 for r in results.values())},
                     indent=2))


if __name__ == "__main__":
    main()
