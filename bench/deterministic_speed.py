"""The price of `--deterministic` in process (issue 31): bench/strata_offline.py's fixed load
(32 x 128 -> 64) and one stream (1 x 128 -> 128, decode tokens/s) on the default model's GGUF
weights as `strata serve` serves them (Q4_1 stays quantized), with `set_deterministic` off or
on; the best of `--rounds`. Run the two modes as separate processes, interleaved:

    for i in 1 2 3; do for m in off on; do
        .venv/bin/python bench/deterministic_speed.py --mode $m; done; done

`--mode off` is `strata serve --no-deterministic`, `on` is `--deterministic` (since 2026-12-06
the default for quantized weights; before, `default` named off and `deterministic` on, and those
names still work).
"""

from __future__ import annotations

import argparse
import json

import torch
from strata_offline import CACHE_DIR, build_engine, fixed

from strata.model import gemm
from strata.model.determinism import set_deterministic
from strata.model.fetch import resolve_model
from strata.model.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["off", "on", "default", "deterministic"], default="on")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--weights-dtype", choices=["auto", "bf16"], default="auto",
                    help="auto: the GGUF's Q4_1 as served; bf16: dequantized at load")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    set_deterministic(a.mode in ("on", "deterministic"))
    path = resolve_model(None, cache_dir=CACHE_DIR, progress=False)
    loaded = load_model(path, dtype="bfloat16", cache_dir=CACHE_DIR, weights_dtype=a.weights_dtype)
    vocab = loaded.config.vocab_size
    engine = build_engine(loaded, prefix_cache=True, chunked=True, max_num_batched_tokens=512,
                          max_num_seqs=64, prefill_stretch=0.0)
    fixed(engine, 4, 32, 8, vocab, seed=99)  # warm up
    best = {"fixed_tokens_per_s": 0.0, "one_stream_decode_tokens_per_s": 0.0}
    for i in range(a.rounds):
        engine.reset_prefix_cache()
        load = fixed(engine, 32, 128, 64, vocab, seed=i + 1)["tokens_per_s"]
        engine.reset_prefix_cache()
        one = fixed(engine, 1, 128, 128, vocab, seed=i + 5)["decode_tokens_per_s"]
        best["fixed_tokens_per_s"] = max(best["fixed_tokens_per_s"], round(load, 1))
        best["one_stream_decode_tokens_per_s"] = max(best["one_stream_decode_tokens_per_s"],
                                                     round(one, 1))
    print(json.dumps({"mode": a.mode, "threads": a.threads, "amx": gemm.has_amx(), **best}))


if __name__ == "__main__":
    main()
