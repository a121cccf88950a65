"""LoRA adapters on the default model (issue 26's benchmarks; not run in CI).

(a) Throughput on the fixed load (32 x 128 -> 64, ignore_eos, prefix cache off) with every
    request on one of K rank-8 adapters (round-robin; K = 0 is the base), the K settings
    interleaved in each round on one engine; each reported as its ratio to the base of the same
    round (median over rounds). Issue target: >= 0.85x the base at 4 adapters.
(b) Cold load of a rank-8 adapter, file to first token: `load_adapter` (read, digest, checks,
    bf16), `Engine.add_lora`, then a 128-token prompt on it until its first token; a fresh
    adapter directory each time (the files are in the page cache, as after a download). Beside
    it the same prompt's first token on the base. Issue target: <= 100 ms.
(c) With `--max-cpu-loras N`: cold on-demand loads with eviction, as `strata serve
    --max-cpu-loras N` does them: N + 1 adapters known, requests round-robin over them, so each
    one misses, evicts the least recently used adapter and loads its own (strata/server/loras.py
    over an AsyncEngine: read and checks off the event loop, add between steps), then its
    128-token prompt runs to the first token. Reported: acquire (evict + read + checks + add),
    first token, and the sum (file to first token).

The adapters are random PEFT LoRA directories (adapter_config.json + adapter_model.safetensors,
PEFT's key names) targeting q, k, v, o, gate, up and down, written by this script.

Usage (JSON on stdout):
    .venv/bin/python bench/lora.py [--rounds 3] [--cold 5] [--cold-only] [--model DIR]
        [--threads 2] [--max-cpu-loras N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from strata_offline import build_engine, load, make_request, run  # noqa: E402
from workload import random_prompts  # noqa: E402

from strata.engine.engine import Engine  # noqa: E402
from strata.model.config import ModelConfig  # noqa: E402
from strata.model.loader import LoadedModel  # noqa: E402
from strata.model.lora import TARGET_MODULES, load_adapter  # noqa: E402
from strata.server.async_engine import AsyncEngine  # noqa: E402
from strata.server.config import ServerConfig  # noqa: E402
from strata.server.loras import LoraTable  # noqa: E402
from strata.server.metrics import ServerMetrics  # noqa: E402

COUNTS = (0, 1, 4, 16)
RANK = 8
N, LIN, LOUT = 32, 128, 64


def shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each target module."""
    q, kv, h, i = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.hidden_size, c.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def write_adapter(out: Path, config: ModelConfig, base: str, seed: int) -> Path:
    """A random rank-8 PEFT LoRA adapter of every target module, as `save_pretrained` writes."""
    gen = torch.Generator().manual_seed(seed)
    tensors, sizes = {}, shapes(config)
    for layer in range(config.num_hidden_layers):
        for module in TARGET_MODULES:
            part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            n_out, n_in = sizes[module]
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, n_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, RANK, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 16, "target_modules": list(TARGET_MODULES),
        "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": base}))
    return out


def throughput(engine: Engine, digests: list[str], vocab: int) -> float:
    """Output tokens/s of the fixed load, request i on adapter i % K (none when K = 0)."""
    requests = [make_request(p, LOUT) for p in random_prompts(N, LIN, vocab, seed=0)]
    for i, r in enumerate(requests):
        if digests:
            r.lora_digest = digests[i % len(digests)]
            r.lora_name = f"a{i % len(digests)}"
    t0 = time.perf_counter()
    tl = run(engine, requests)
    seconds = time.perf_counter() - t0
    total = sum(len(v) for v in tl.tokens.values())
    assert total == N * LOUT, total
    return total / seconds


def bench_throughput(loaded: LoadedModel, root: Path, rounds: int) -> dict[str, Any]:
    engine = build_engine(loaded, prefix_cache=False)
    digests = []
    for k in range(max(COUNTS)):
        path = write_adapter(root / f"tp{k}", loaded.config, str(loaded.source), seed=k)
        digests.append(engine.add_lora(load_adapter(f"a{k}", path, loaded.config,
                                                    dtype=torch.bfloat16)))
    throughput(engine, digests[:4], loaded.config.vocab_size)  # warm-up, adapters included
    per_round: list[dict[int, float]] = []
    for i in range(rounds):
        order = COUNTS[i % len(COUNTS):] + COUNTS[:i % len(COUNTS)]  # rotate who goes first
        per_round.append({k: throughput(engine, digests[:k], loaded.config.vocab_size)
                          for k in order})
        print(f"round {i + 1}: {per_round[-1]}", file=sys.stderr, flush=True)
    result: dict[str, Any] = {}
    for k in COUNTS:
        tps = [r[k] for r in per_round]
        ratios = [r[k] / r[0] for r in per_round]
        result[str(k)] = {"tokens_per_s": [round(x, 1) for x in tps],
                          "median_tokens_per_s": round(statistics.median(tps), 1),
                          "ratio_to_base": [round(x, 3) for x in ratios],
                          "median_ratio": round(statistics.median(ratios), 3)}
    result["target_4_adapters_met"] = result["4"]["median_ratio"] >= 0.85
    return result


def first_token_ms(engine: Engine, prompt: list[int], digest: str = "") -> float:
    request = make_request(prompt, 1)
    request.lora_digest, request.lora_name = digest, "cold" if digest else ""
    t0 = time.perf_counter()
    engine.add_request(request)
    while not any(o.new_token_ids for o in engine.step()):
        pass
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - t0) * 1000


def bench_cold(loaded: LoadedModel, root: Path, times: int) -> dict[str, Any]:
    engine = build_engine(loaded, prefix_cache=False)
    prompts = random_prompts(times + 1, LIN, loaded.config.vocab_size, seed=1)
    first_token_ms(engine, prompts[-1])  # warm-up
    rows = []
    for i in range(times):
        path = write_adapter(root / f"cold{i}", loaded.config, str(loaded.source), seed=100 + i)
        t0 = time.perf_counter()
        adapter = load_adapter("cold", path, loaded.config, dtype=torch.bfloat16)
        digest = engine.add_lora(adapter)
        load_ms = (time.perf_counter() - t0) * 1000
        token_ms = first_token_ms(engine, prompts[i], digest)
        base_ms = first_token_ms(engine, prompts[i])
        engine.retire_lora(digest)
        rows.append({"load_ms": load_ms, "first_token_ms": token_ms,
                     "file_to_first_token_ms": load_ms + token_ms, "base_first_token_ms": base_ms})
    summary = {key: round(statistics.median(r[key] for r in rows), 1) for key in rows[0]}
    return {"median": summary, "runs": [{k: round(v, 1) for k, v in r.items()} for r in rows],
            "adapter_bytes": os.path.getsize(root / "cold0" / "adapter_model.safetensors"),
            "target_met": summary["file_to_first_token_ms"] <= 100.0}


def bench_on_demand(loaded: LoadedModel, root: Path, times: int, max_cpu_loras: int
                    ) -> dict[str, Any]:
    names = [f"od{k}" for k in range(max_cpu_loras + 1)]
    paths = {n: str(write_adapter(root / n, loaded.config, str(loaded.source), seed=200 + k))
             for k, n in enumerate(names)}
    engine = AsyncEngine(build_engine(loaded, prefix_cache=False), max_model_len=2048)
    config = ServerConfig(served_model_name="bench", max_cpu_loras=max_cpu_loras,
                          lora_paths=dict(paths))
    metrics = ServerMetrics("bench")
    dtype = torch.bfloat16

    def loader(name: str, path: str) -> Any:
        return load_adapter(name, path, loaded.config, dtype=dtype)

    async def first_token_after(name: str, prompt: list[int]) -> tuple[float, float]:
        t0 = time.perf_counter()
        await table.acquire(name)
        t1 = time.perf_counter()
        request = make_request(prompt, 1)
        request.lora_name, request.lora_digest = name, config.loras[name]
        async for _ in engine.generate(request):
            break
        table.release(name)
        return (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000

    async def go() -> list[dict[str, float]]:
        engine.start()
        prompts = random_prompts(times + len(names), LIN, loaded.config.vocab_size, seed=2)
        for k, name in enumerate(names[:-1]):  # warm: N resident
            await first_token_after(name, prompts[times + k])
        rows = []
        for i in range(times):
            acquire_ms, token_ms = await first_token_after(names[(i + len(names) - 1)
                                                                 % len(names)], prompts[i])
            rows.append({"acquire_ms": acquire_ms, "first_token_ms": token_ms,
                         "file_to_first_token_ms": acquire_ms + token_ms})
        await engine.shutdown(10.0)
        return rows

    table = LoraTable(engine, config, loader, metrics.lora)
    rows = asyncio.run(go())
    registry = metrics.registry
    summary = {key: round(statistics.median(r[key] for r in rows), 1) for key in rows[0]}
    return {"max_cpu_loras": max_cpu_loras, "adapters": len(names), "median": summary,
            "runs": [{k: round(v, 1) for k, v in r.items()} for r in rows],
            "evictions": registry.get_sample_value("strata:lora_evictions_total",
                                                   {"model_name": "bench"})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", type=int, default=5, help="cold loads to time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold-only", action="store_true", help="skip the throughput part")
    ap.add_argument("--max-cpu-loras", type=int, default=0,
                    help="N > 0: also (c), cold on-demand loads with eviction over N + 1 adapters")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load(a.model)
    with tempfile.TemporaryDirectory(prefix="strata-lora-bench-") as tmp:
        root = Path(tmp)
        out = {"model": loaded.name, "rank": RANK, "load": f"{N} x {LIN} -> {LOUT}",
               "rounds": a.rounds, "threads": a.threads,
               "throughput": None if a.cold_only else bench_throughput(loaded, root, a.rounds),
               "cold_load": bench_cold(loaded, root, a.cold),
               "on_demand": bench_on_demand(loaded, root, a.cold, a.max_cpu_loras)
               if a.max_cpu_loras > 0 else None}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
