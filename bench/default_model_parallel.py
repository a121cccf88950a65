"""The default model (SmolLM2-135M, float32) at T=2, T=3, P=2 and T=2 x P=2 against one process
on all 50 prompts of tests/harness/default_parallel.py (the test runs 10 of them): how many
greedy continuations are identical, the worst logprob difference before parting, and where any
part (only at near ties: the rule raises otherwise). Minutes per layout on 2 cores.

    .venv/bin/python bench/default_model_parallel.py [--layouts tp2,pp2] [--prompts 50]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.default_parallel import ALL_PROMPTS, compare, run  # noqa: E402
from serve_process import shared_model_cache  # noqa: E402

from strata.model.executor import TorchExecutor  # noqa: E402
from strata.model.fetch import resolve_model  # noqa: E402
from strata.model.loader import load_model  # noqa: E402
from strata.model.parallel.executor import ParallelExecutor  # noqa: E402
from strata.model.parallel.layout import ParallelLayout  # noqa: E402
from strata.model.parallel.shard_loader import prepare_model  # noqa: E402

LAYOUTS = {"tp2": (2, 1), "tp3": (3, 1), "pp2": (1, 2), "tp2xpp2": (2, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--prompts", type=int, default=len(ALL_PROMPTS))
    args = parser.parse_args()
    prompts = ALL_PROMPTS[:args.prompts]
    cache = shared_model_cache()
    path = resolve_model(None, cache_dir=cache, progress=False)
    loaded = load_model(path, dtype="float32", cache_dir=cache)
    torch.set_num_threads(1)  # as each rank runs
    single = run(TorchExecutor(loaded.config, loaded.weights, dtype="float32"),
                 loaded.config.vocab_size, loaded.tokenizer, prompts)
    results = {}
    for name in args.layouts.split(","):
        tensor, pipeline = LAYOUTS[name]
        prepared = prepare_model(path, dtype="float32", cache_dir=cache)
        executor = ParallelExecutor(prepared, ParallelLayout(tensor, pipeline), dtype="float32",
                                    threads=1)
        try:
            split = run(executor, prepared.config.vocab_size, prepared.tokenizer, prompts)
        finally:
            executor.shutdown()
        result = compare(single, split, prompts)
        print(result.line(name), result.partings, flush=True)
        results[name] = {"identical": result.num_identical, "prompts": result.num_prompts,
                         "worst_logprob_difference": result.worst_logprob_difference,
                         "partings": result.partings}
    out = ROOT / ".bench" / "results" / "default_model_parallel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
