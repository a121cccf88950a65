"""The cost of constrained decoding on the Stage 1 fixed load (bench/workload.py: 32 prompts x
128 tokens in, 64 out, greedy, ignore_eos), SmolLM2 bf16, offline (Engine.step directly).

Usage (JSON on stdout, one line per round on stderr):
    .venv/bin/python bench/structured_cost.py [--rounds 3] [--threads 2] [--model PATH]

Modes, interleaved round by round (the median of each is reported):
- `plain`: no constraint (the sampler's argmax fast path).
- `json`: every request constrained by a JSON schema (an array of at least 40
  {"name": string <= 12, "score": integer} objects, so no answer completes within 64 tokens
  and every mode computes the same number of tokens); masks computed beside the forward.
- `json_serial`: the same, but each mask is filled on the engine thread before the forward
  (what the mask thread saves).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from strata_offline import build_engine, load  # noqa: E402
from workload import INPUT_LEN, NUM_PROMPTS, OUTPUT_LEN, random_prompts  # noqa: E402

from strata.engine.executor import ScheduledSequence  # noqa: E402
from strata.engine.request import Request, SamplingParams  # noqa: E402
from strata.model.grammar import Grammars, GrammarSpec  # noqa: E402
from strata.model.masks import MaskWorker, PendingMasks, disallowed_tokens  # noqa: E402
from strata.types import RequestId  # noqa: E402

SCHEMA = {"type": "array", "minItems": 40,
          "items": {"type": "object", "additionalProperties": False,
                    "required": ["name", "score"],
                    "properties": {"name": {"type": "string", "maxLength": 12},
                                   "score": {"type": "integer"}}}}


class SerialMasks(MaskWorker):
    """Fills the masks at once, on the calling (engine) thread."""

    def start(self, sampled: list[ScheduledSequence]) -> PendingMasks | None:
        rows = [i for i, s in enumerate(sampled) if s.sampling_params.constraint is not None]
        if not rows:
            return None
        future: Future[torch.Tensor] = Future()
        future.set_result(disallowed_tokens(
            [sampled[i].sampling_params.constraint for i in rows],  # type: ignore[misc]
            self.vocab_size))
        return PendingMasks(rows, len(sampled), future)


def one_round(engine: Any, grammars: Grammars | None, prompts: list[list[int]],
              tag: str) -> dict[str, float]:
    compiled = grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))) \
        if grammars else None
    for i, p in enumerate(prompts):
        constraint = grammars.constraint(compiled) if grammars and compiled else None
        params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True,
                                constraint=constraint)
        engine.add_request(Request(RequestId(f"{tag}-{i}"), list(p), params))
    start = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    assert num_tokens == len(prompts) * OUTPUT_LEN, num_tokens
    return {"tokens_per_s": num_tokens / seconds, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(args.model)
    vocab = loaded.config.vocab_size
    engine = build_engine(loaded, prefix_cache=False)
    executor = engine.executor
    grammars = Grammars(loaded.tokenizer, vocab)
    beside, serial = executor.masks, SerialMasks(vocab)  # type: ignore[attr-defined]
    prompts = random_prompts(NUM_PROMPTS, INPUT_LEN, vocab, seed=0)
    one_round(engine, None, prompts[:4], "warmup")
    results: dict[str, list[float]] = {"plain": [], "json": [], "json_serial": []}
    for r in range(args.rounds):
        for mode in results:
            executor.masks = serial if mode == "json_serial" else beside  # type: ignore[attr-defined]
            res = one_round(engine, None if mode == "plain" else grammars, prompts, f"{mode}{r}")
            results[mode].append(res["tokens_per_s"])
            print(f"round {r} {mode:12s} {res['tokens_per_s']:7.1f} tok/s", file=sys.stderr)
    medians = {mode: statistics.median(v) for mode, v in results.items()}
    report = {"workload": {"prompts": NUM_PROMPTS, "input_len": INPUT_LEN,
                           "output_len": OUTPUT_LEN, "threads": args.threads},
              "tokens_per_s": {m: round(v, 1) for m, v in medians.items()},
              "rounds": {m: [round(x, 1) for x in v] for m, v in results.items()},
              "cost_beside_pct": round(100 * (1 - medians["json"] / medians["plain"]), 1),
              "cost_serial_pct": round(100 * (1 - medians["json_serial"] / medians["plain"]), 1)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
