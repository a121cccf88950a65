"""LoRA adapters on a tensor-parallel instance (issue 26; not run in CI).

(a) Throughput of a fixed load (N x L_in -> L_out, ignore_eos, prefix cache off) on a T-rank
    ParallelExecutor (T = 1: one process's TorchExecutor) with every request on one of K
    rank-8 adapters of every module (round-robin; K = 0 is the base), the K settings
    interleaved in each round on one engine, each reported as its ratio to the base of the
    same round (median over rounds).
(b) Adding one adapter already read and checked in the model's dtype: `add_lora` (T > 1: the
    AddLora command pickled and broadcast, each rank cutting its share; T = 1: nothing to
    copy), median of three.

The adapters are bench/lora.py's (random PEFT directories, q k v o gate up down, rank 8).

Usage (JSON on stdout):
    .venv/bin/python bench/lora_parallel.py [--tensor 2] [--rounds 3] [--num 16]
        [--input-len 64] [--output-len 32] [--dtype bfloat16] [--threads 1] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora import write_adapter  # noqa: E402
from strata_offline import CACHE_DIR, make_request, run  # noqa: E402
from workload import random_prompts  # noqa: E402

from strata.engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from strata.engine.engine import Engine  # noqa: E402
from strata.engine.executor import ModelExecutor  # noqa: E402
from strata.model.executor import TorchExecutor  # noqa: E402
from strata.model.fetch import resolve_model  # noqa: E402
from strata.model.loader import load_model  # noqa: E402
from strata.model.lora import LoraAdapter, load_adapter  # noqa: E402
from strata.model.parallel.executor import ParallelExecutor  # noqa: E402
from strata.model.parallel.layout import ParallelLayout  # noqa: E402
from strata.model.parallel.shard_loader import prepare_model  # noqa: E402

COUNTS = (0, 4)


def engine_over(executor: ModelExecutor, vocab: int, tokenizer: Any) -> Engine:
    num_blocks = CacheConfig.blocks_for_gb(0.5, executor.kv_bytes_per_token(), 16)
    return Engine(executor, CacheConfig(block_size=16, num_blocks=num_blocks,
                                        enable_prefix_caching=False),
                  SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                  max_model_len=2048, enable_chunked_prefill=True),
                  tokenizer, vocab_size=vocab)


def throughput(engine: Engine, digests: list[str], vocab: int, a: argparse.Namespace) -> float:
    """Output tokens/s of the load, request i on adapter i % K (none when K = 0)."""
    requests = [make_request(p, a.output_len)
                for p in random_prompts(a.num, a.input_len, vocab, seed=0)]
    for i, r in enumerate(requests):
        if digests:
            r.lora_digest, r.lora_name = digests[i % len(digests)], f"a{i % len(digests)}"
    t0 = time.perf_counter()
    tl = run(engine, requests)
    seconds = time.perf_counter() - t0
    total = sum(len(v) for v in tl.tokens.values())
    assert total == a.num * a.output_len, total
    return total / seconds


def median_add_ms(add: Any, adapters: list[LoraAdapter]) -> float:
    times = []
    for adapter in adapters:
        t0 = time.perf_counter()
        add(adapter)
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tensor", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = resolve_model(a.model, cache_dir=CACHE_DIR, progress=False)
    prepared = prepare_model(path, dtype=a.dtype, cache_dir=CACHE_DIR)
    config, vocab = prepared.config, prepared.config.vocab_size
    dtype = getattr(torch, a.dtype)
    executor: ParallelExecutor | TorchExecutor
    if a.tensor > 1:
        executor = ParallelExecutor(prepared, ParallelLayout(a.tensor, 1), dtype=a.dtype,
                                    threads=a.threads)
    else:
        loaded = load_model(path, dtype=a.dtype, cache_dir=CACHE_DIR)
        executor = TorchExecutor(loaded.config, loaded.weights, dtype=a.dtype)
    out: dict[str, Any] = {"model": prepared.name, "tensor": a.tensor, "dtype": a.dtype,
                           "threads_per_rank": a.threads,
                           "load": f"{a.num} x {a.input_len} -> {a.output_len}"}
    try:
        with tempfile.TemporaryDirectory(prefix="strata-lora-tp-") as tmp:
            adapters = [load_adapter(f"a{k}", write_adapter(Path(tmp) / f"a{k}", config,
                                                            str(path), seed=k),
                                     config, dtype=dtype) for k in range(max(COUNTS) + 3)]
        engine = engine_over(executor, vocab, prepared.tokenizer)
        out["add_ms"] = median_add_ms(executor.add_lora, adapters[max(COUNTS):])
        digests = [executor.add_lora(x) for x in adapters[:max(COUNTS)]]
        throughput(engine, digests, vocab, a)  # warm-up, adapters included
        rounds: list[dict[int, float]] = []
        for i in range(a.rounds):
            order = COUNTS[i % 2:] + COUNTS[:i % 2]
            rounds.append({k: throughput(engine, digests[:k], vocab, a) for k in order})
            print(f"round {i + 1}: {rounds[-1]}", file=sys.stderr, flush=True)
        for k in COUNTS:
            out[f"adapters_{k}"] = {
                "tokens_per_s": [round(r[k], 1) for r in rounds],
                "median_ratio_to_base": round(statistics.median(r[k] / r[0] for r in rounds), 3)}
    finally:
        if isinstance(executor, ParallelExecutor):
            executor.shutdown()
    out["adapter_bytes"] = adapters[0].num_bytes
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
