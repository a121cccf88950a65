"""Chunked prefill at the default 512-token budget: the adaptive prefill cap against none.

Interleaved rounds of, for each setting (`--prefill-stretch` 1.5, the default, and 0, the
behaviour before it):
  interference  16 streams decode 256 tokens; after 24 steps a 1,500-token prompt arrives: ITL
                p50 / p99 / max of the decoding streams, the long prompt's TTFT, and the run's
                output tokens/s (the throughput cost of the cap)
  fixed         32 x 128 -> 64, all at once: output tokens/s
Default model (its GGUF, `--weights-dtype` as given), both cores.

    .venv/bin/python bench/prefill_stretch.py [--rounds 3] [--weights-dtype auto]

Marked slow: not in CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata_offline import CACHE_DIR, build_engine, fixed, interference  # noqa: E402

from strata.model.fetch import resolve_model  # noqa: E402
from strata.model.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights-dtype", default="auto")
    ap.add_argument("--stretches", type=float, nargs="+", default=[1.5, 0.0])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = resolve_model(None, cache_dir=CACHE_DIR, progress=False)
    loaded = load_model(path, cache_dir=CACHE_DIR, weights_dtype=a.weights_dtype)
    vocab = loaded.config.vocab_size
    engines = {s: build_engine(loaded, prefill_stretch=s) for s in a.stretches}
    for e in engines.values():
        fixed(e, 4, 32, 8, vocab, seed=99)  # warm-up
    rows: dict[float, list[dict]] = {s: [] for s in a.stretches}
    loads = []
    for r in range(a.rounds):
        loads.append(os.getloadavg()[0])
        for s, e in engines.items():
            e.reset_prefix_cache()
            t0 = time.perf_counter()
            res = interference(e, 16, 1500, vocab)
            res["interference_tok_s"] = (16 * 256 + 8) / (time.perf_counter() - t0)
            res["fixed_tok_s"] = fixed(e, 32, 128, 64, vocab, seed=10 + r)["tokens_per_s"]
            rows[s].append(res)
            print(f"round {r} load {loads[-1]:.1f} stretch {s}: p50 {res['itl_p50'] * 1e3:.1f} "
                  f"ms p99 {res['itl_p99'] * 1e3:.1f} ms p99/p50 {res['p99_over_p50']:.2f} max "
                  f"{res['itl_max'] * 1e3:.0f} ms TTFT {res['long_prompt_ttft']:.2f} s, "
                  f"{res['interference_tok_s']:.0f} tok/s; fixed {res['fixed_tok_s']:.0f} tok/s",
                  flush=True)
    print(f"\nload average {min(loads):.1f}-{max(loads):.1f}; medians of {a.rounds} rounds "
          "[min..max]")
    print("| --prefill-stretch | ITL p50 | ITL p99 | p99/p50 | max ITL | long-prompt TTFT | "
          "interference tok/s | fixed 32x128->64 tok/s |")
    print("|---|---|---|---|---|---|---|---|")

    def cell(s: float, key: str, scale: float = 1.0, fmt: str = ".1f") -> str:
        v = [x[key] * scale for x in rows[s]]
        return f"{statistics.median(v):{fmt}} [{min(v):{fmt}}..{max(v):{fmt}}]"

    for s in a.stretches:
        print(f"| {s} | {cell(s, 'itl_p50', 1e3)} ms | {cell(s, 'itl_p99', 1e3)} ms | "
              f"**{cell(s, 'p99_over_p50', fmt='.2f')}** | {cell(s, 'itl_max', 1e3, '.0f')} ms | "
              f"{cell(s, 'long_prompt_ttft', fmt='.2f')} s | "
              f"{cell(s, 'interference_tok_s', fmt='.0f')} | {cell(s, 'fixed_tok_s', fmt='.0f')} |")


if __name__ == "__main__":
    main()
