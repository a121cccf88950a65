"""The determinism table in one process (issue 31): the default model (its GGUF's Q4_1 weights
as served, or dequantized to bf16), 12 random 60-token prompts, 32 tokens greedy; each alone on an
empty prefix cache, again alone with its prefix cached, and inside a batch of 36 (the 12 and 24
others); identical token ids counted per prompt. `--deterministic` runs
`set_deterministic(True)` first (what `strata serve --deterministic` does).

    .venv/bin/python bench/determinism_inprocess.py [--deterministic] [--weights-dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from strata_offline import CACHE_DIR, build_engine

from strata.engine.engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.model import gemm
from strata.model.determinism import set_deterministic
from strata.model.fetch import resolve_model
from strata.model.loader import load_model
from strata.types import RequestId

_ids = iter(range(1_000_000))


def answers(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of `prompts`, all added at once, stepped to the end."""
    ids = []
    for prompt in prompts:
        rid = RequestId(f"d{next(_ids)}")
        ids.append(rid)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(Request(rid, list(prompt), params, arrival_time=time.monotonic()))
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return [got[rid] for rid in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num", type=int, default=12)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--weights-dtype", default="auto", choices=["auto", "bf16"],
                    help="auto: the GGUF's Q4_1 weights as `strata serve` serves them")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    set_deterministic(a.deterministic)
    path = resolve_model(None, cache_dir=CACHE_DIR, progress=False)
    loaded = load_model(path, dtype="bfloat16", cache_dir=CACHE_DIR, weights_dtype=a.weights_dtype)
    engine = build_engine(loaded, prefix_cache=True, chunked=True, max_num_batched_tokens=512,
                          max_num_seqs=64, prefill_stretch=0.0)
    rng = random.Random(7)
    vocab = loaded.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(60)] for _ in range(a.num + 24)]
    alone = []
    for p in prompts[:a.num]:
        engine.reset_prefix_cache()
        alone += answers(engine, [p], a.output_len)
    engine.reset_prefix_cache()
    cached = []
    for p in prompts[:a.num]:
        answers(engine, [p], a.output_len)  # its prefix now in the cache
        cached += answers(engine, [p], a.output_len)
    engine.reset_prefix_cache()
    batched = answers(engine, prompts, a.output_len)[:a.num]
    print(json.dumps({
        "deterministic": a.deterministic, "weights": a.weights_dtype, "amx": gemm.has_amx(),
        "threads": a.threads,
        "cached_equals_alone": sum(c == x for c, x in zip(cached, alone, strict=True)),
        "batched_equals_alone": sum(b == x for b, x in zip(batched, alone, strict=True)),
        "of": a.num}))


if __name__ == "__main__":
    main()
