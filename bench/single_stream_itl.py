"""Single-stream decode, bf16 against --weights-dtype auto (the default GGUF's Q4_1), one thread:
per-token intervals of a 16-token prompt generating 40 tokens, modes alternating, 3 rounds;
prints the running minimum and median ITL of each mode with the load average. On a machine
loaded by others the minimum is the least disturbed figure.

    .venv/bin/python bench/single_stream_itl.py

Marked slow: not in CI.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata_offline import CACHE_DIR, build_engine, make_request, run  # noqa: E402
from workload import random_prompts  # noqa: E402

from strata.model.fetch import resolve_model  # noqa: E402
from strata.model.loader import load_model  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    path = resolve_model(None, cache_dir=CACHE_DIR, progress=False)
    engines = {m: build_engine(load_model(path, cache_dir=CACHE_DIR, weights_dtype=m))
               for m in ("bf16", "auto")}
    vocab = 49152
    itl: dict[str, list[float]] = {m: [] for m in engines}
    for r in range(3):
        for m, e in engines.items():
            tl = run(e, [make_request(random_prompts(1, 16, vocab, r)[0], 40)])
            t = next(iter(tl.tokens.values()))
            itl[m] += [b - a for a, b in zip(t, t[1:], strict=False)]
            print(f"round {r} {m}: min {min(itl[m]) * 1e3:.2f} ms, p50 "
                  f"{statistics.median(itl[m]) * 1e3:.2f} ms, load {os.getloadavg()[0]:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
