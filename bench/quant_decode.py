"""`--weights-dtype` on the default model's GGUF: Strata bf16 / Q4_1 (the file's) / Q8_0 against
llama.cpp (llama-cpp-python) on the same file and threads.

Per round, interleaved (Strata bf16, Strata auto, Strata q8_0, llama.cpp, then again):
  single   one stream, 16 prompt tokens, 256 greedy tokens: decode tokens/s after the first
  batch32  the fixed workload, 32 x 128 -> 64, greedy, ignore_eos: output tokens/s
llama.cpp runs through its low-level API (bench/llama_cpp_batch.py: 32 seq_ids in one
`llama_decode` per step; the high-level API runs one sequence at a time), greedy by argmax.
Once: weight bytes of each mode, and greedy agreement with bf16 (8 prompts x 64 tokens: the
share of streams identical to the end, and the mean length of the common prefix), llama.cpp's
too.

    .venv/bin/python bench/quant_decode.py [--rounds 3] [--threads 2] [--modes bf16 auto auto+det]

A mode is a `--weights-dtype` (bf16, auto, q8_0, q4), run with the determinism switch off, or
one with `+det` appended, run with it on: `strata serve`'s default for quantized weights since
2026-12-06 (`auto+det`), where `auto` is `strata serve --no-deterministic`.

Prints one table; writes JSON to .bench/results/quant_decode.json. Marked slow: not in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama_cpp_batch import LlamaCppBatch  # noqa: E402
from strata_offline import CACHE_DIR, build_engine, fixed, make_request  # noqa: E402
from workload import random_prompts  # noqa: E402

from strata.engine.engine import Engine  # noqa: E402
from strata.model.determinism import set_deterministic  # noqa: E402
from strata.model.fetch import resolve_model  # noqa: E402
from strata.model.loader import LoadedModel, load_model  # noqa: E402
from strata.model.quant_loader import weight_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / ".bench" / "results"


def strata_single(engine: object, vocab: int, n: int = 256) -> float:
    res = fixed(engine, 1, 16, n, vocab, seed=1)  # type: ignore[arg-type]
    return float(res["decode_tokens_per_s"])


def llama_cpp_single(llm: LlamaCppBatch, vocab: int, n: int = 256) -> float:
    return llm.single(random_prompts(1, 16, vocab, 1)[0], n)


def llama_cpp_batch32(llm: LlamaCppBatch, vocab: int, seed: int) -> float:
    return llm.fixed(random_prompts(32, 128, vocab, seed), 64)[0]


def greedy(engine: object, prompts: list[list[int]], n: int) -> list[list[int]]:
    reqs = [make_request(p, n) for p in prompts]
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)  # type: ignore[attr-defined]
    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        for o in engine.step():  # type: ignore[attr-defined]
            outs[o.request_id].extend(o.new_token_ids)
    return [outs[r.request_id] for r in reqs]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    prefixes = [next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
                for r, g in zip(ref, got, strict=True)]
    return {"identical_streams": sum(p == len(r) for p, r in zip(prefixes, ref, strict=True)),
            "streams": len(ref), "mean_common_prefix": statistics.fmean(prefixes),
            "tokens": len(ref[0])}


def switched(mode: str, engine: Engine) -> Engine:
    """`engine`, with the process's determinism switch set as `mode` asks (it is global)."""
    set_deterministic(mode.endswith("+det"))
    return engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["bf16", "auto", "auto+det"])
    ap.add_argument("--no-llama-cpp", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = resolve_model(None, cache_dir=CACHE_DIR, progress=False)
    loaded: dict[str, LoadedModel] = {
        m: load_model(path, cache_dir=CACHE_DIR, weights_dtype=m.removesuffix("+det"))
        for m in a.modes}
    vocab = next(iter(loaded.values())).config.vocab_size
    engines = {m: build_engine(lm) for m, lm in loaded.items()}
    memory = {m: weight_bytes(lm.weights) / 1e6 for m, lm in loaded.items()}
    llm = None
    if not a.no_llama_cpp:
        try:
            llm = LlamaCppBatch(str(path), a.threads)
        except ImportError as e:
            print(f"llama-cpp-python not importable ({e}): llama.cpp column skipped")
    prompts = random_prompts(8, 32, vocab, 9)
    outputs = {m: greedy(switched(m, e), prompts, 64) for m, e in engines.items()}
    if llm is not None:
        outputs["llama.cpp"] = llm.generate(prompts, 64)
    agree = {m: agreement(outputs[a.modes[0]], out) for m, out in outputs.items()}
    if llm is not None and "auto" in outputs:
        print(f"llama.cpp against Strata auto: {agreement(outputs['auto'], outputs['llama.cpp'])}")
    single: dict[str, list[float]] = {m: [] for m in [*a.modes, "llama.cpp"]}
    batch: dict[str, list[float]] = {m: [] for m in [*a.modes, "llama.cpp"]}
    loads = []
    for r in range(a.rounds):
        loads.append(os.getloadavg()[0])
        for m, e in engines.items():
            single[m].append(strata_single(switched(m, e), vocab))
            batch[m].append(fixed(switched(m, e), 32, 128, 64, vocab, seed=100 + r)["tokens_per_s"])
        if llm is not None:
            single["llama.cpp"].append(llama_cpp_single(llm, vocab))
            batch["llama.cpp"].append(llama_cpp_batch32(llm, vocab, seed=100 + r))
        print(f"round {r}: load {loads[-1]:.1f} single "
              + " ".join(f"{m} {v[-1]:.1f}" for m, v in single.items() if v)
              + " | batch32 " + " ".join(f"{m} {v[-1]:.0f}" for m, v in batch.items() if v),
              flush=True)
    med = {m: statistics.median(v) for m, v in single.items() if v}
    print(f"\nload average {min(loads):.1f}-{max(loads):.1f}; medians of {a.rounds} rounds, "
          "[min..max]")
    print("| weights | weight MB | x bf16 | single-stream tok/s | batch-32 tok/s | "
          "greedy vs bf16 |")
    print("|---|---|---|---|---|---|")
    for m in [*a.modes, *(["llama.cpp"] if llm is not None else [])]:
        g = agree[m]
        mem = (f"{memory[m]:.1f} | {memory[m] / memory[a.modes[0]]:.2f}" if m in memory
               else "- | -")
        print(f"| {m} | {mem} | "
              f"**{med[m]:.1f}** [{min(single[m]):.1f}..{max(single[m]):.1f}] | "
              f"**{statistics.median(batch[m]):.0f}** [{min(batch[m]):.0f}..{max(batch[m]):.0f}]"
              f" | {g['identical_streams']}/{g['streams']} streams identical over "
              f"{g['tokens']} tokens, common prefix {g['mean_common_prefix']:.1f} |")
    if llm is not None:
        for m in a.modes:
            print(f"Strata {m} / llama.cpp: single {med[m] / med['llama.cpp']:.2f}x, batch-32 "
                  f"{statistics.median(batch[m]) / statistics.median(batch['llama.cpp']):.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if llm is not None:
        llm.close()
    (RESULTS / "quant_decode.json").write_text(json.dumps(
        {"load": loads, "single": single, "batch32": batch, "memory_mb": memory,
         "agreement": agree}, indent=1))


if __name__ == "__main__":
    main()
